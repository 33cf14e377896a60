"""The installed ``hf-posenc`` console script, run as a user runs it: exit status 0 after a recipe succeeds, 1 with
one line (no traceback, no results) on a user error met while running, 2 with one line on a bad flag or input; the
same status under ``accelerate launch`` and ``torchrun``. Tiny runs, the checkout first on ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **{name: value for name, value in os.environ.items() if name != "ACCELERATE_USE_CPU"},
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    "HF_HUB_OFFLINE": "1",  # nothing here needs the Hub; a name that is not a folder must not wait for it
}
TINY_PRETRAIN = [
    "pretrain", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "16",
    "--max_train_steps", "2", "--eval_steps", "2",
]  # fmt: skip


def console_script() -> str:
    """The ``hf-posenc`` script that ``pip install`` wrote (``[project.scripts]``), beside this Python first."""
    script = Path(sysconfig.get_path("scripts")) / "hf-posenc"
    if script.is_file():
        return str(script)
    found = shutil.which("hf-posenc")
    if found is None:
        pytest.fail("the hf-posenc console script is not installed: pip install -e .")
    return found


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300)


def short_text(folder: Path) -> Path:
    """Text with enough bytes for a training block of 16 but not for a validation block (the first 5 % of lines)."""
    path = folder / "short.txt"
    path.write_text("ab\n" * 40)
    return path


def test_console_script_exits_0_after_a_recipe_succeeds(tmp_path):
    argv = ["probe", "--families", "gpt2", "--schemes", "none", "--variants", "softmax", "--length", "4"]
    result = run([console_script(), *argv, "--max_train_steps", "2", "--output_dir", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'relative_mse'" not in result.stderr  # the results are written, not dumped on stderr
    assert json.loads((tmp_path / "probe_results.json").read_text())[0]["scheme"] == "none"


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (
            [*TINY_PRETRAIN, "--train_file", "{short}"],
            1,
            "hf-posenc pretrain: error: The text is too short for one block of 16 tokens in train and validation.",
        ),
        (
            ["extrapolate", "--model_name_or_path", "{missing}"],
            2,
            "hf-posenc extrapolate: error: --model_name_or_path {missing}: no such folder",
        ),
        (["glue", "--frobnicate"], 2, "hf-posenc glue: error: the following arguments are required: "),
        (["frobnicate"], 2, "hf-posenc: error: unknown recipe 'frobnicate'; valid: pretrain, compare, "),
    ],
)
def test_console_script_reports_a_user_error_in_one_line_and_exits_non_zero(argv, status, message, tmp_path):
    paths = {"short": short_text(tmp_path), "missing": tmp_path / "missing"}
    result = run([console_script(), *(arg.format(**paths) for arg in argv)], tmp_path)
    assert result.returncode == status, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(message.format(**paths)), result.stderr[-3000:]
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
    result = run([*LAUNCHERS[launcher], "hf_posenc_cli", *argv], tmp_path)
    assert result.returncode != 0
    error = "hf-posenc pretrain: error: The text is too short for one block of 16 tokens in train and validation."
    assert result.stderr.count(error) == 2, result.stderr[-3000:]
    assert 'File "' + str(ROOT) not in result.stderr  # no traceback through the recipe's code
