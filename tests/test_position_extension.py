"""extend_positions: hierarchical decomposition (kexue.fm/archives/7947) and interpolation of a learned table."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_model, random_ids

import hf_posenc
from hf_posenc.position_extension import hierarchical_table, interpolated_table


def test_hierarchical_table_by_hand():
    p = torch.tensor([[1.0], [2.0], [4.0]])  # n = 3, alpha = 0.4
    u = (p - 0.4 * p[0]) / 0.6  # [1, 8/3, 6]
    table = hierarchical_table(p, 9, alpha=0.4)
    torch.testing.assert_close(table[:3], p)  # trained positions unchanged
    torch.testing.assert_close(table[5], 0.4 * u[1] + 0.6 * u[2])  # 5 = 1 * 3 + 2
    torch.testing.assert_close(table[7], 0.4 * u[2] + 0.6 * u[1])  # 7 = 2 * 3 + 1


def test_interpolated_table_by_hand():
    table = interpolated_table(torch.tensor([[0.0], [10.0]]), 5)
    torch.testing.assert_close(table[:, 0], torch.tensor([0.0, 2.5, 5.0, 7.5, 10.0]))


@pytest.mark.parametrize("method", ["hierarchical", "interpolate"])
def test_extended_model_reads_longer_inputs_and_round_trips(family, method, tmp_path):
    model = make_model(family, "learned")
    ids = random_ids(1, 60)
    with pytest.raises(ValueError, match="outside the learned position table of 40"):
        model(ids)
    hf_posenc.extend_positions(model, 64, method=method)
    assert model.config.position_encoding["max_positions"] == 64 and model.config.max_position_embeddings == 64
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


def test_hierarchical_extension_keeps_short_inputs_exact(family):
    model = make_model(family, "learned")
    ids = random_ids(2, 30)
    with torch.no_grad():
        before = model(ids).logits
        after = hf_posenc.extend_positions(model, 100)(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("scheme", "kwargs", "message"),
    [
        ("rope", {"max_positions": 80}, r"'learned' position table; got RoPE"),
        ("learned", {"max_positions": 30}, r"larger than the current table \(40\); got 30"),
        ("learned", {"max_positions": 2000}, r"at most n\^2 = 1600 positions; got 2000"),
        ("learned", {"max_positions": 80, "method": "yarn"}, r"Unknown method 'yarn'; valid choices"),
        ("learned", {"max_positions": 80, "alpha": 1.0}, r"alpha must be in \(0, 1\)"),
    ],
)
def test_bad_extensions_raise(scheme, kwargs, message):
    with pytest.raises(ValueError, match=message):
        hf_posenc.extend_positions(make_model("bert", scheme), **kwargs)


@pytest.mark.parametrize(
    ("model_type", "class_name", "extra"),
    [
        ("bert", "BertForMaskedLM", dict(hidden_size=32, num_attention_heads=4, max_position_embeddings=40)),
        ("roberta", "RobertaForMaskedLM", dict(hidden_size=32, num_attention_heads=4, max_position_embeddings=42)),
        ("gpt2", "GPT2LMHeadModel", dict(n_embd=32, n_head=4, n_positions=40)),
    ],
)
@pytest.mark.parametrize("method", ["hierarchical", "interpolate"])
def test_stock_models_extend_and_round_trip(model_type, class_name, extra, method, tmp_path):
    """A stock table grows in place (RoBERTa keeps its rows before padding_idx + 1); hierarchically, the trained
    positions keep their outputs exactly."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=61, num_hidden_layers=2, intermediate_size=48, pad_token_id=1, **extra
    )
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    short, long = random_ids(2, 30), random_ids(1, 60)
    with torch.no_grad():
        before = model(short).logits
        hf_posenc.extend_positions(model, 64, method=method)
        after = model(short).logits
        logits = model(long).logits
    if method == "hierarchical":
        assert torch.equal(after, before)
    offset = 2 if model_type == "roberta" else 0
    assert model.config.max_position_embeddings == 64 + offset
    model.save_pretrained(tmp_path)
    reloaded = getattr(transformers, class_name).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(long).logits, logits)
