"""The installed ``hf-posenc`` console script, run as a user runs it: 1 with one line (no traceback, no results) on a
user error met while running, 2 with one line on a bad flag or input; the same under ``accelerate launch`` and
``torchrun``. Exit status 0 after a recipe succeeds: the pretrained model of ``test_recipes.py`` (``alibi_decoder``)
is trained by the console script. Tiny runs, the checkout first on ``PYTHONPATH``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CLI_ENV, ROOT, console_script, run_command

from hf_posenc_recipes import catalogue
from hf_posenc_recipes.parsers import PARSERS
from hf_posenc_recipes.registry import RECIPES


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


def test_a_log_redirected_to_a_file_holds_no_progress_lines(tmp_path):
    """stderr not a terminal (here a pipe, as a file is): no progress bar of the recipe, of datasets or of
    Transformers writes to it; what is left is the warning that 2 steps end inside the default warm-up of 60."""
    result = run_command([console_script(), *TINY_PRETRAIN, "--output_dir", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "it/s" not in result.stderr and "\r" not in result.stderr and "%|" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        "hf-posenc pretrain: warning: --max_train_steps 2 does not exceed --num_warmup_steps 60: the learning rate is "
        "still warming up when training stops (no step at its peak, no decay), so the losses are those of a model "
        "barely trained, not of the schedule; give more steps or a shorter --num_warmup_steps."
    ]
    assert "step 2: eval loss" in result.stdout


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    + ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"],
}


def test_every_recipe_file_runs_as_a_script_from_outside_the_checkout(tmp_path):
    """``python recipes/<recipe>.py --help`` from another folder: each recipe's file is a script, as Transformers'
    example scripts are; its usage is the command's (``hf-posenc <recipe>``); a bad flag exits 2. The scripts run
    side by side (most of each is importing torch)."""
    scripts = {recipe: [sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), "--help"] for recipe in RECIPES}
    scripts["bad flag"] = [sys.executable, str(ROOT / "recipes" / "pretrain.py"), "--position_encoding", "rotary"]
    runs = {
        name: subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLI_ENV, cwd=tmp_path
        )
        for name, command in scripts.items()
    }
    results = {name: (run.communicate(timeout=300), run.returncode) for name, run in runs.items()}
    (_, bad_stderr), bad_status = results.pop("bad flag")
    assert bad_status == 2 and "unknown position_encoding 'rotary'" in bad_stderr
    for recipe, ((stdout, stderr), status) in results.items():
        assert status == 0, stderr[-3000:]
        assert stdout.startswith(f"usage: hf-posenc {recipe} "), stdout[:200]


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_user_error_fails_the_launch_of_two_processes(launcher, tmp_path):
    """Both processes meet the error while running, print it in one line and exit 1; the launcher reports the run
    failed (its own report of a failed child is the launcher's). A successful launch exits 0: see
    test_recipes.py (torchrun: pretrain; accelerate: probe)."""
    argv = [*TINY_PRETRAIN, "--train_file", str(short_text(tmp_path)), "--output_dir", str(tmp_path / "out")]
    result = run_command([*LAUNCHERS[launcher], "hf_posenc_recipes", *argv], tmp_path)
    assert result.returncode != 0
    error = "hf-posenc pretrain: error: The text is too short for one block of 16 tokens in train and validation."
    assert result.stderr.count(error) == 2, result.stderr[-3000:]
    for folder in ("hf_posenc", "recipes"):  # no traceback through the recipe's code (the launcher's own is)
        assert f'File "{ROOT / folder}' not in result.stderr


BAD_INPUTS = [
    (
        ["pretrain", "--position_encoding", "rotary"],
        "hf-posenc pretrain: error: argument --position_encoding: unknown position_encoding 'rotary'; valid choices: "
        "['alibi',",
    ),
    (
        ["pretrain", "--position_encoding", "{bad json"],
        "hf-posenc pretrain: error: argument --position_encoding: '{bad json' is not valid JSON (Expecting property "
        "name enclosed in double quotes, character 1); give a name or a JSON dict such as",
    ),
    (
        ["pretrain", "--position_encoding", '{"type": "rope", "thetaa": 500000}'],
        "hf-posenc pretrain: error: argument --position_encoding: unknown option(s) ['thetaa'] for position_encoding "
        "'rope'; valid options: ['apply_to_value', ",
    ),
    (
        ["pretrain", "--position_encoding", '["rope", {"type": "none", "floor_scale": "8192"}]'],
        "hf-posenc pretrain: error: argument --position_encoding: position_encoding 'none': option 'floor_scale' "
        "must be float or int, got '8192' (str)",
    ),
    (
        ["pretrain", "--attention_normalizer", '{"type": "softmax", "toeplitz_gate": 1}'],
        "hf-posenc pretrain: error: argument --attention_normalizer: attention_normalizer 'softmax': option "
        "'toeplitz_gate' must be bool, got 1 (int)",
    ),
    (
        ["compare", "--schemes", "rope", "rotary"],
        "hf-posenc compare: error: argument --schemes: unknown position_encoding 'rotary'; valid: learned, ",
    ),
    (["compare", "--threads", "-1"], "hf-posenc compare: error: argument --threads: expected an integer >= 0, got -1"),
    (
        ["compare", "--schemes", "rope:theta=-1"],
        "hf-posenc compare: error: argument --schemes: position_encoding 'rope': option 'theta'=-1 is out of range; "
        "valid: a number > 1",
    ),
    (
        ["pretrain", "--position_encoding", '{"type": "t5", "num_buckets": 0}'],
        "hf-posenc pretrain: error: argument --position_encoding: position_encoding 't5': option 'num_buckets'=0 is "
        "out of range; valid: an even int >= 4",
    ),
    (
        ["probe", "--variants", "softmax+gate", "--schemes", "alibi:max_positions=0.5"],
        "hf-posenc probe: error: argument --schemes: unknown option(s) ['max_positions'] for position_encoding",
    ),
    (
        ["glue", "--model_name_or_path", "m", "--task_name", "rte", "--output_dir", "o", "--attention_normalizer"]
        + ['{"type": "ssmax", "initial_scale": Infinity}'],
        "hf-posenc glue: error: argument --attention_normalizer: attention_normalizer 'ssmax': option "
        "'initial_scale'=inf is out of range; valid: finite",
    ),
    *(
        ([recipe, *required, "--threads", "x"], f"hf-posenc {recipe}: error: argument --threads: expected an integer")
        for recipe, required in (
            ("pretrain", []),
            ("extrapolate", ["--model_name_or_path", "m"]),
            ("probe", []),
            ("retrofit", []),
            ("glue", ["--model_name_or_path", "m", "--task_name", "rte", "--output_dir", "o"]),
        )
    ),  # fmt: skip
    (
        ["compare", "--output_dir", "{file}/compare-output"],
        "hf-posenc compare: error: argument --output_dir: {file}/compare-output: {file} is a file, not a folder",
    ),
    (
        ["glue", "--model_name_or_path", "m", "--task_name", "rte", "--output_dir", "{file}"],
        "hf-posenc glue: error: argument --output_dir: {file} is a file, not a folder",
    ),
    (
        ["glue", "--model_name_or_path", "m", "--task_name", "rte", "--output_dir", "o", "--retrofit", "rotary"],
        "hf-posenc glue: error: argument --retrofit: unknown position_encoding 'rotary'; valid choices: ",
    ),
    (
        ["probe", "--schemes", "shaw:use_valu=false"],
        "hf-posenc probe: error: argument --schemes: unknown option(s) ['use_valu'] for position_encoding 'shaw'",
    ),
    (
        ["probe", "--variants", "sparsemax+gate"],
        "hf-posenc probe: error: argument --variants: unknown attention_normalizer 'sparsemax'; valid choices: ",
    ),
    (
        ["retrofit", "--normalizers", "sparsemax"],
        "hf-posenc retrofit: error: argument --normalizers: unknown attention_normalizer 'sparsemax'; valid: ",
    ),
]
STOP_WITHOUT_TORCH = """
import sys
from hf_posenc_recipes.cli import main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    assert stop.code == 2, stop.code
loaded = sorted(name for name in ("torch", "transformers", "accelerate", "hf_posenc") if name in sys.modules)
assert not loaded, f"a bad input was reported after importing {loaded}"
"""


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS, ids=[" ".join(argv[:2]) for argv, _ in BAD_INPUTS])
def test_a_bad_scheme_option_or_output_dir_stops_with_exit_2_before_torch_is_imported(argv, message, tmp_path):
    """The installed command exits 2 with one line naming the value and the valid choices; the same arguments
    stop ``hf_posenc_recipes.cli.main`` before torch, transformers or hf_posenc is imported."""
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [arg.replace("{file}", str(file)) for arg in argv]
    result = run_command([console_script(), *argv], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr[-3000:]
    assert result.stderr.startswith(message.replace("{file}", str(file))), result.stderr
    in_process = run_command([sys.executable, "-c", STOP_WITHOUT_TORCH, *argv], tmp_path)
    assert in_process.returncode == 0, in_process.stderr[-3000:]


def test_the_commands_catalogue_is_the_registries():
    """``recipes/catalogue.json`` (what the command checks names and options against without torch) is the
    registries' own description; after adding or changing a scheme: python -m hf_posenc_recipes.catalogue."""
    assert catalogue.load_catalogue() == catalogue.build_catalogue(), "run: python -m hf_posenc_recipes.catalogue"


def number_probes(record: dict, types: tuple[type, ...]) -> list:
    """Numbers around every bound of a range record (and 0, small integers, infinities, NaN), of the option's
    types."""
    bounds = [value for key, value in record.items() if key not in ("finite", "multiple_of")]
    integers = sorted({*range(-3, 11), *(round(bound) + step for bound in bounds for step in (-1, 0, 1))})
    probes = list(integers) if int in types else []
    if float in types:
        probes += [float(value) for value in integers]
        probes += [bound + step for bound in bounds for step in (-0.5, -1e-9, 1e-9, 0.5)]
        probes += [float("inf"), float("-inf"), float("nan"), 0.37, 2.5]
    return probes


def test_the_catalogues_number_ranges_are_the_options_own_checks():
    """Every number option with a range check has a range record in the catalogue (the command checks it before
    torch loads), and the record accepts exactly the numbers the option's own check accepts, around every bound."""
    from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
    from hf_posenc.position_encodings import POSITION_ENCODINGS

    checked = 0
    for registry in (POSITION_ENCODINGS, ATTENTION_NORMALIZERS):
        for name, entry in registry.items():
            for key, option in entry.options.items():
                record = catalogue.describe_option(option)["range"]
                numeric = {int, float} & set(option.types)
                assert (record is not None) == (option.check is not None and bool(numeric)), (name, key)
                for value in number_probes(record, option.types) if record is not None else []:
                    assert catalogue.in_range(value, record) == bool(option.check(value)), (name, key, value)
                    checked += 1
    assert checked > 1000


def test_a_range_is_read_from_the_options_words():
    """The phrases of an option's ``valid`` words, each read into its bounds; words no phrase reads are refused."""
    assert catalogue.number_range("an even int >= 4") == {"minimum": 4, "multiple_of": 2}
    assert catalogue.number_range("0 < x <= 1") == {"exclusive_minimum": 0, "maximum": 1}
    assert catalogue.number_range("a number in (0, 1)") == {"exclusive_minimum": 0, "exclusive_maximum": 1}
    assert catalogue.number_range("a finite number >= 0") == {"finite": True, "minimum": 0}
    assert catalogue.number_range('"learned" or a finite number') == {"finite": True}
    with pytest.raises(ValueError, match="no phrase of NUMBER_PHRASES reads 'a prime'"):
        catalogue.number_range("a prime")


@pytest.mark.parametrize("recipe", list(PARSERS))
def test_help_states_each_default_once(recipe, monkeypatch):
    """Defaults are argparse's ``(default: ...)``; a help string says what None means (``when None: ...``) rather
    than a second "(default ...)"."""
    monkeypatch.setenv("COLUMNS", "10000")
    help_text = PARSERS[recipe]().format_help()
    assert not re.search(r"\(default(?!: )", help_text), re.findall(r".*\(default(?!: ).*", help_text)


def test_a_per_layer_position_encoding_is_a_json_list():
    """``--position_encoding`` takes one spec per layer as a JSON list, each checked against the catalogue."""
    from hf_posenc_recipes.parsers.pretrain import pretrain_parser

    layers = '["rope", {"type": "none", "attn_temperature_tuning": true}]'
    args = pretrain_parser().parse_args(["--position_encoding", layers])
    assert args.position_encoding == ["rope", {"type": "none", "attn_temperature_tuning": True}]
