"""The interpreted CUDA grid's driver on CPU, without the tool: every model of its grid is a valid config that runs,
and a results file's cases (dict specs in their names) are read back for a resumed run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import hf_posenc


def load_grid(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_interpret_grid.py"
    spec = importlib.util.spec_from_file_location("cuda_interpret_grid", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cuda_interpret_grid", module)
    spec.loader.exec_module(module)
    return module


def test_every_model_of_the_grid_builds_and_runs(monkeypatch):
    grid = load_grid(monkeypatch)
    models = list(grid.grid_models())
    catalogue = hf_posenc.list_position_encodings()
    assert {scheme for _, scheme, normalizer in models if isinstance(scheme, str) and normalizer == "softmax"} >= set(
        catalogue
    )
    assert {normalizer for _, _, normalizer in models if isinstance(normalizer, str)} >= set(
        hf_posenc.list_attention_normalizers()
    )

    def tool_model(family, scheme, normalizer, heads, attn):  # the tool's tiny models, as its make_model builds them
        if family == "bert":
            config = hf_posenc.PosEncBertConfig(
                position_encoding=scheme, attention_normalizer=normalizer, hidden_size=64, num_hidden_layers=1,
                num_attention_heads=heads, intermediate_size=64, vocab_size=99, max_position_embeddings=64,
            )  # fmt: skip
            return hf_posenc.PosEncBertForMaskedLM(config)
        config = hf_posenc.PosEncGPT2Config(
            position_encoding=scheme, attention_normalizer=normalizer, n_embd=64, n_layer=1, n_head=heads,
            vocab_size=99, n_positions=64,
        )  # fmt: skip
        return hf_posenc.PosEncGPT2LMHeadModel(config)

    make = grid.with_layouts(tool_model)
    ids = torch.randint(3, 99, (1, grid.LENGTH))
    for family, scheme, normalizer in models:
        model = make(family, scheme, normalizer, 2, "eager")
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, grid.LENGTH, 99) and torch.isfinite(logits).all(), (family, scheme, normalizer)
    layouts = [model for model in models if isinstance(model[1], dict) and "layout" in model[1]]
    assert [scheme["layout"] for _, scheme, _ in layouts] == list(grid.LAYOUTS)


def test_a_resumed_grid_skips_the_recorded_tasks(monkeypatch, tmp_path, capsys):
    grid = load_grid(monkeypatch)
    tasks = grid.tasks((32,), ("float32",))
    gated = next(task for task in tasks if isinstance(task[2], dict) and "output_gate" in task[2])
    train, infer = grid.case_names(gated)
    results = tmp_path / "grid.log"
    results.write_text(
        f"PASS {train}: loss err 0.0e+00 (max |ref| 4.6), 20 grads (5.0 s)\n"
        f"FAIL {infer} @ numbers: logits err 1.0e+00 > 1.0e-04 (max |ref| 1.2) (4.0 s)\n"
    )
    assert grid.recorded_cases(results) == [("PASS", train), ("FAIL", infer)]
    assert grid.summarize(results) == 1
    argv = ["cuda_interpret_grid.py", str(results), "--head-dims", "32", "--dtypes", "float32", "--list"]
    monkeypatch.setattr(sys, "argv", argv)
    assert grid.main() == 0
    listed = capsys.readouterr().out.splitlines()
    assert str(gated) not in listed and str(tasks[0]) in listed
    assert listed[-1] == f"{len(tasks) - 1} tasks left"
