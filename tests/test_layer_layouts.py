"""Per-layer layouts: ``position_encoding`` as a list of specs (one per attention layer), Transformers' Llama 4 /
SmolLM3 ``no_rope_layers`` convention, and Llama 4's attention temperature on NoPE layers. The behaviours every
combination keeps (cache, padding, backends, checkpointing, save/load, bf16) run on the layouts of
``conftest.LAYOUTS`` in ``test_model_properties.py``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_config, make_model, random_ids
from transformers import GPT2Config, GPT2LMHeadModel, Llama4TextConfig, SmolLM3Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_posenc
from hf_posenc.absolute_encodings import attention_temperature


TEMPERATURE = {"type": "none", "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5}


def test_a_per_layer_list_is_stored_as_full_specs(tmp_path):
    config = make_config("gpt2", ["rope", {"type": "t5", "num_buckets": 8}])
    config.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["position_encoding"]
    assert [spec["type"] for spec in stored] == ["rope", "t5"]
    assert stored[0]["theta"] == 10000.0 and stored[1]["num_buckets"] == 8 and stored[1]["max_distance"] == 128
    assert hf_posenc.PosEncGPT2Config.from_pretrained(tmp_path).position_encoding == stored


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["rope"], r"one spec per attention layer: 2 \(num_hidden_layers\); got 1"),
        (["learned", "rope"], r"\['learned'\], which act once on the input embeddings"),
        (["rope", "sinusoidal"], r"\['sinusoidal'\], which act once on the input embeddings"),
        (["rope", "rotary"], r"Unknown position_encoding 'rotary'"),
    ],
)
def test_a_bad_per_layer_list_is_refused_when_the_config_is_built(family, value, message):
    with pytest.raises(ValueError, match=message):
        make_config(family, value)


def test_an_input_side_scheme_on_every_layer_is_that_scheme():
    model = make_model("gpt2", ["learned", "learned"])
    assert type(model.transformer.position_encoding).__name__ == "LearnedAbsolute"
    assert "transformer.position_encoding.table.weight" in model.state_dict()


def test_layers_with_equal_specs_share_the_scheme_and_its_parameters():
    model = make_model("bert", ["t5", "rope", "t5"], num_hidden_layers=3)
    encoding = model.bert.position_encoding
    assert encoding.layer_encoding(0) is encoding.layer_encoding(2)
    assert [name for name, _ in encoding.named_parameters()] == ["schemes.0.relative_attention_steps.weight"]


@pytest.mark.parametrize(("layers", "interval"), [(8, 4), (6, 2), (5, 3)])
def test_no_rope_layer_interval_places_nope_layers_as_llama4_and_smollm3_do(layers, interval):
    config = make_config("gpt2", "rope", n_layer=layers, no_rope_layer_interval=interval)
    for reference in (
        Llama4TextConfig(num_hidden_layers=layers, no_rope_layer_interval=interval),
        SmolLM3Config(num_hidden_layers=layers, no_rope_layer_interval=interval),
    ):
        uses_rope = [spec["type"] == "rope" for spec in config.position_encoding]
        assert uses_rope == [bool(flag) for flag in reference.no_rope_layers]


def test_no_rope_layers_gives_the_spec_where_the_flag_is_1():
    spec = {"type": "rope", "theta": 500000.0}
    config = make_config("bert", spec, num_hidden_layers=3, no_rope_layers=[1, 0, 1])
    assert [layer["type"] for layer in config.position_encoding] == ["rope", "none", "rope"]
    assert config.position_encoding[2]["theta"] == 500000.0
    assert not hasattr(config, "no_rope_layers")  # the list it gives is what the config stores


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"no_rope_layers": [1, 0, 1]}, r"no_rope_layers has one flag per attention layer: 2"),
        ({"no_rope_layers": [1, 2]}, r"no_rope_layers must be a list of 0 \(NoPE\) and 1"),
        ({"no_rope_layer_interval": 0}, r"no_rope_layer_interval must be an int >= 1; got 0"),
        ({"no_rope_layers": [1, 0], "no_rope_layer_interval": 4}, "not both"),
    ],
)
def test_bad_no_rope_layers_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_config("gpt2", "rope", **kwargs)


def test_attention_temperature_is_llama4s_formula():
    """Llama 4 (``Llama4TextAttention``): ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``."""
    positions = torch.tensor([0, 8190, 8191, 16382, 16383, 100000])
    expected = [1.0, 1.0, 1.0 + 0.1 * torch.log(torch.tensor(2.0)), 1.0 + 0.1 * torch.log(torch.tensor(2.0))]
    expected += [1.0 + 0.1 * torch.log(torch.tensor(3.0)), 1.0 + 0.1 * torch.log(torch.tensor(13.0))]
    torch.testing.assert_close(attention_temperature(positions, 8192.0, 0.1), torch.tensor(expected))


def test_none_defaults_to_nope_and_takes_llama4s_temperature_defaults():
    spec = make_config("gpt2", "none").position_encoding
    assert spec == {"type": "none", "attn_temperature_tuning": False, "floor_scale": 8192.0, "attn_scale": 0.1}
    llama4 = Llama4TextConfig()
    assert (llama4.floor_scale, llama4.attn_scale) == (spec["floor_scale"], spec["attn_scale"])


def hand_gpt2_logits(model, ids: torch.Tensor, positions: torch.Tensor, layers: list[dict]) -> torch.Tensor:
    """GPT-2 written out by hand with each layer's scheme: ``rope`` through Transformers' Llama
    ``apply_rotary_pos_emb`` with ``theta^(-2i/d)`` frequencies, ``none`` with Llama 4's temperature on q."""
    base = model.transformer
    hidden = base.wte(ids)
    n, heads = ids.shape[1], model.config.n_head
    head_dim = model.config.n_embd // heads
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for block, spec in zip(base.h, layers, strict=True):
        x = block.ln_1(hidden)
        q, k, v = (t.view(*x.shape[:2], heads, head_dim).transpose(1, 2) for t in block.attn.c_attn(x).split(32, -1))
        if spec["type"] == "rope":
            inverse = spec["theta"] ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            angles = positions[:, :, None].float() * inverse
            emb = torch.cat([angles, angles], -1)
            q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
        elif spec["attn_temperature_tuning"]:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / spec["floor_scale"])) * spec["attn_scale"] + 1
            q = q * scale[:, None, :, None]
        scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)
        hidden = hidden + block.attn.c_proj(out)
        hidden = hidden + block.mlp(block.ln_2(hidden))
    return model.lm_head(base.ln_f(hidden))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_each_layer_runs_its_own_scheme_as_a_hand_written_gpt2(attn):
    layers = [{"type": "rope", "theta": 100.0}, TEMPERATURE, {"type": "rope", "theta": 100.0}]
    model = make_model("gpt2", layers, attn=attn, n_layer=3)
    ids = random_ids(2, 9)
    positions = torch.arange(9)[None].expand(2, -1) + torch.tensor([[3], [11]])  # the temperature steps inside
    specs = model.config.position_encoding
    with torch.no_grad():
        logits = model(ids, position_ids=positions).logits
        expected = hand_gpt2_logits(model, ids, positions, specs)
        uniform_none = hand_gpt2_logits(model, ids, positions, [specs[1]] * 3)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert (logits - uniform_none).abs().max() > 1e-2  # the rope layers matter


def test_temperature_makes_none_absolute_and_a_shift_changes_it():
    spec = make_config("gpt2", TEMPERATURE).position_encoding
    assert not hf_posenc.position_encodings.POSITION_ENCODINGS["none"].is_relative(spec)
    model = make_model("gpt2", TEMPERATURE)
    ids = random_ids(2, 9)
    with torch.no_grad():
        shifted = model(ids, position_ids=torch.arange(9)[None] + 13).logits
        assert (shifted - model(ids, position_ids=torch.arange(9)[None]).logits).abs().max() > 1e-3


def test_retrofit_refuses_a_per_layer_list():
    stock = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=40))
    with pytest.raises(ValueError, match=r"retrofit\(\) gives every layer one position_encoding"):
        hf_posenc.retrofit(stock, ["rope", "none"])


def test_convert_gives_a_stock_gpt2_a_per_layer_layout_and_keeps_its_table_on_every_layer():
    stock = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=40)).eval()
    ids = random_ids(2, 9)
    kept = hf_posenc.convert(stock, ["learned", "learned"]).eval()
    layered = hf_posenc.convert(stock, ["rope", "none"]).eval()
    assert [spec["type"] for spec in layered.config.position_encoding] == ["rope", "none"]
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, stock(ids).logits, atol=1e-5, rtol=1e-4)
        assert torch.isfinite(layered(ids).logits).all()
    longer = hf_posenc.extend_positions(kept, 60)
    assert [spec["max_positions"] for spec in longer.config.position_encoding] == [60, 60]
