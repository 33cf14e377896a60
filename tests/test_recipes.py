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
