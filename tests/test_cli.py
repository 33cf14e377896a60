"""The installed ``hf-posenc`` console script, run as a user runs it: 1 with one line (no traceback, no results) on a
user error met while running, 2 with one line on a bad flag or input; the same under ``accelerate launch`` and
``torchrun``. Exit status 0 after a recipe succeeds: the pretrained model of ``test_recipes.py`` (``alibi_decoder``)
is trained by the console script. Tiny runs, the checkout first on ``PYTHONPATH``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ROOT, console_script, run_command


TINY_PRETRAIN = [
    "pretrain", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "16",
    "--max_train_steps", "2", "--eval_steps", "2",
]  # fmt: skip


def short_text(folder: Path) -> Path:
    """Text with enough bytes for a training block of 16 but not for a validation block (the first 5 % of lines)."""
    path = folder / "short.txt"
    path.write_text("ab\n" * 40)
    return path


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (
            [*TINY_PRETRAIN, "--train_file", "{short}"],
            1,
            "hf-posenc pretrain: error: The text is too short for one block of 16 tokens in train and validation.",
        ),
        (["glue", "--frobnicate"], 2, "hf-posenc glue: error: the following arguments are required: "),
        (["frobnicate"], 2, "hf-posenc: error: unknown recipe 'frobnicate'; valid: pretrain, compare, "),
    ],
)
def test_console_script_reports_a_user_error_in_one_line_and_exits_non_zero(argv, status, message, tmp_path):
    argv = [str(short_text(tmp_path)) if arg == "{short}" else arg for arg in argv]
    result = run_command([console_script(), *argv], tmp_path)
    assert result.returncode == status, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(message), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "{" not in last


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    + ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"],
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_user_error_fails_the_launch_of_two_processes(launcher, tmp_path):
    """Both processes meet the error while running, print it in one line and exit 1; the launcher reports the run
    failed (its own report of a failed child is the launcher's). A successful launch exits 0: see
    test_recipes.py (torchrun: pretrain; accelerate: probe)."""
    argv = [*TINY_PRETRAIN, "--train_file", str(short_text(tmp_path)), "--output_dir", str(tmp_path / "out")]
    result = run_command([*LAUNCHERS[launcher], "hf_posenc_cli", *argv], tmp_path)
    assert result.returncode != 0
    error = "hf-posenc pretrain: error: The text is too short for one block of 16 tokens in train and validation."
    assert result.stderr.count(error) == 2, result.stderr[-3000:]
    for package in ("hf_posenc", "hf_posenc_cli"):  # no traceback through the recipe's code (the launcher's own is)
        assert f'File "{ROOT / package}' not in result.stderr
