"""The attention-shape options of both families: QK-norm (``use_qk_norm``) against stock Qwen3's attention and
logit soft-capping (``attn_logit_softcapping``) against stock Gemma 2's, on the same weights; the backend that runs a
soft-cap; FlexAttention's path against eager. The shared properties (cache, padding, backends) are in
test_model_properties.py."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import (
    HEAD_DIM,
    HIDDEN,
    combos_in_turn_by_family,
    make_config,
    make_model,
    random_ids,
    stock_attention_config,
)
from test_remote_code import LOAD_WITHOUT_HF_POSENC
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.qwen3 import modeling_qwen3

from hf_posenc import attention_backends


def first_attention_call(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and output of the first layer's attention module (GPT-2: after ``ln_1``, before the residual)."""
    seen = {}

    def record(module, args, output):
        seen["input"], seen["output"] = args[0], output[0]

    handle = model.transformer.h[0].attn.register_forward_hook(record)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen["input"], seen["output"]


def copy_gpt2_projections(attention, stock: torch.nn.Module) -> None:
    """GPT-2's fused ``c_attn`` (``Conv1D``: ``x W + b``, q, k, v side by side) and ``c_proj`` into a Llama-style
    module's ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (``nn.Linear``: ``x W^T + b``)."""
    weight, bias = attention.c_attn.weight, attention.c_attn.bias
    with torch.no_grad():
        for index, name in enumerate(("q_proj", "k_proj", "v_proj")):
            part = slice(index * HIDDEN, (index + 1) * HIDDEN)
            getattr(stock, name).weight.copy_(weight[:, part].T)
            getattr(stock, name).bias.copy_(bias[part])
        stock.o_proj.weight.copy_(attention.c_proj.weight.T)
        stock.o_proj.bias.copy_(attention.c_proj.bias)


def causal_additive_mask(length: int) -> torch.Tensor:
    hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, length, length).masked_fill(hidden, torch.finfo(torch.float32).min)


STOCK_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def stock_rope_config(config_class: type, **fields) -> transformers.PretrainedConfig:
    """A one-layer stock config of the conftest models' width, full attention with default RoPE."""
    return stock_attention_config(
        config_class,
        vocab_size=61,
        rope_parameters=STOCK_ROPE,
        max_position_embeddings=40,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        **fields,
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qk_norm_with_rope_is_qwen3_attention(attn):
    """A PosEnc GPT-2 layer with ``rope`` and ``use_qk_norm`` computes ``Qwen3Attention`` (its ``q_norm``/``k_norm``
    on each head after the projections, then the rotation): the same projections, norm weights and input give the
    same output."""
    model = make_model("gpt2", "rope", attn=attn, use_qk_norm=True)
    attention = model.transformer.h[0].attn
    torch.manual_seed(3)
    with torch.no_grad():  # away from their init (1), so that a missing or misplaced norm shows
        attention.q_norm.weight.normal_(1.0, 0.5)
        attention.k_norm.weight.normal_(1.0, 0.5)
    config = stock_rope_config(transformers.Qwen3Config, rms_norm_eps=model.config.layer_norm_epsilon)
    qwen3 = modeling_qwen3.Qwen3Attention(config, layer_idx=0).eval()
    copy_gpt2_projections(attention, qwen3)
    with torch.no_grad():
        qwen3.q_norm.weight.copy_(attention.q_norm.weight)
        qwen3.k_norm.weight.copy_(attention.k_norm.weight)
    hidden_states, ours = first_attention_call(model, random_ids(2, 12))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        cos_sin = modeling_qwen3.Qwen3RotaryEmbedding(config)(hidden_states, positions)
        theirs, _ = qwen3(hidden_states, position_embeddings=cos_sin, attention_mask=causal_additive_mask(12))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [0.5, 3.0])
def test_logit_softcapping_with_rope_is_gemma2_eager_attention(cap):
    """A PosEnc GPT-2 layer with ``rope`` and ``attn_logit_softcapping`` computes ``Gemma2Attention``'s eager path
    (``c tanh(s / c)`` of the scaled scores, then the mask and softmax), with ``query_pre_attn_scalar = head_dim``
    (its scaling GPT-2's ``1/sqrt(head_dim)``). SDPA was requested: the cap sends it to eager."""
    model = make_model("gpt2", "rope", attn="sdpa", attn_logit_softcapping=cap)
    config = stock_rope_config(transformers.Gemma2Config, query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=cap)
    gemma2 = modeling_gemma2.Gemma2Attention(config, layer_idx=0).eval()
    copy_gpt2_projections(model.transformer.h[0].attn, gemma2)
    hidden_states, ours = first_attention_call(model, random_ids(2, 12))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        cos_sin = modeling_gemma2.Gemma2RotaryEmbedding(config)(hidden_states, positions)
        theirs, _ = gemma2(hidden_states, position_embeddings=cos_sin, attention_mask=causal_additive_mask(12))
        uncapped = make_model("gpt2", "rope", attn="eager")
        _, without_cap = first_attention_call(uncapped, random_ids(2, 12))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert (ours - without_cap).abs().max() > 1e-3  # the cap changed the attention


def test_sdpa_refuses_a_soft_cap_with_its_reason_and_the_model_runs_eager(caplog):
    ids = random_ids(2, 9)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    outputs = {}
    attention_backends._log.cache_clear()  # logged once per process
    with caplog.at_level(logging.INFO, logger="hf_posenc"):
        for attn in ("eager", "sdpa"):
            model = make_model("gpt2", "t5", attn=attn, attn_logit_softcapping=1.0)
            with torch.no_grad():
                outputs[attn] = model(ids, attention_mask=attention_mask).logits
    assert "SDPA's kernel computes its scores inside and cannot cap them" in caplog.text
    assert torch.equal(outputs["sdpa"], outputs["eager"])


@pytest.mark.parametrize(
    ("device", "requested", "normalizer", "expected"),
    [
        ("cpu", "sdpa", "softmax", "eager"),
        ("cpu", "flex_attention", "softmax", "flex_attention"),
        ("cuda", "sdpa", "softmax", "flex_attention"),
        ("cpu", "sdpa", "stick_breaking", "sdpa"),  # the chunked eager composition caps as eager does
        ("cuda", "sdpa", "l2", "flex_attention"),
    ],
)
def test_the_backend_choice_of_a_soft_cap(device, requested, normalizer, expected):
    """``choose_backend`` with a cap: never SDPA's fused kernel. A CPU flex request is honoured under no_grad with a
    head of 32 (compiled FlexAttention's CPU limits); on CUDA the default request runs FlexAttention."""
    normalizer_spec = make_config("gpt2", attention_normalizer=normalizer).attention_normalizer
    scheme_spec = make_config("gpt2", "t5").position_encoding
    with torch.no_grad():
        chosen = attention_backends.choose_backend(
            requested, scheme_spec, normalizer_spec, torch.device(device), head_dim=32, logit_softcapping=1.0
        )
        uncapped = attention_backends.choose_backend(
            requested, scheme_spec, normalizer_spec, torch.device(device), head_dim=32
        )
    assert chosen == expected
    if normalizer == "softmax" and requested == "sdpa":
        assert uncapped == "sdpa"


OPTION_CASES = [
    {"use_qk_norm": True},
    {"attn_logit_softcapping": 1.0},
    {"use_qk_norm": True, "attn_logit_softcapping": 1.0},
]
FLEX_COMBOS = (
    [(scheme, "softmax") for scheme in ("learned", "t5", "rope", "alibi", "shaw", "deberta", ["rope", "t5"])]
    + [("t5", normalizer) for normalizer in ("l2", "sigmoid", "ssmax", "softpick", "differential")]
    + [("t5", {"type": "softmax", "sink": "learned"})]
)
# The soft-cap with every combination (each normalizer's flex path reads the capped scores), in both families;
# QK-norm (before the scheme, whatever the normalizer) alone or with the cap with every other combination.
QK_NORM, SOFT_CAP, BOTH = OPTION_CASES
FLEX_CASES = combos_in_turn_by_family(
    [
        (*combo, options)
        for index, combo in enumerate(FLEX_COMBOS)
        for options in ((SOFT_CAP, QK_NORM) if index % 2 else (BOTH, SOFT_CAP))
    ]
)


def options_id(value):
    return "+".join(value) if isinstance(value, dict) and "type" not in value else None


@pytest.mark.parametrize(("family", "scheme", "normalizer", "options"), FLEX_CASES, ids=options_id)
def test_flex_path_with_the_options_equals_eager(family, scheme, normalizer, options, uncompiled_flex):
    """The soft-cap as a ``score_mod`` chained after the scheme's and the layer's terms (every normalizer's flex
    path reads the capped scores), QK-norm before the scheme: uncompiled FlexAttention against eager."""
    ids = random_ids(2, 10)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 7:] = 0
    outputs = {}
    for attn in ("eager", "flex_attention"):
        model = make_model(family, scheme, normalizer, attn=attn, **options)
        with torch.no_grad():
            outputs[attn] = model(ids, attention_mask=attention_mask).logits
    assert uncompiled_flex  # FlexAttention ran
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs["flex_attention"][visible], outputs["eager"][visible], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attn_logit_softcapping": 0.0}, r"attn_logit_softcapping must be None \(off\) or a number > 0, .* got 0.0"),
        ({"attn_logit_softcapping": "50"}, r"attn_logit_softcapping must be None .* or a number > 0, .* got '50'"),
        ({"attn_logit_softcapping": float("nan")}, r"attn_logit_softcapping must be .* got nan"),
        ({"use_qk_norm": 1}, r"use_qk_norm must be True or False; got 1"),
    ],
)
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_bad_option_values_are_refused_when_the_config_is_built(family, options, message):
    with pytest.raises(ValueError, match=message):
        make_config(family, **options)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_qk_norm_weights_start_at_one_and_are_saved(family, tmp_path):
    model = make_model(family, "t5", use_qk_norm=True, attn_logit_softcapping=30)
    norms = {name: p for name, p in model.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(norms) == 2 * model.config.num_hidden_layers
    assert all(torch.equal(p, torch.ones(HEAD_DIM)) for p in norms.values())
    assert model.config.attn_logit_softcapping == 30.0
    with torch.no_grad():
        for p in norms.values():
            p.normal_(1.0, 0.5)
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.use_qk_norm and reloaded.config.attn_logit_softcapping == 30.0
    ids = random_ids(2, 7)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_compiled_flex_attention_caps_and_normalises_like_eager(family):
    """The compiled CPU kernel (inference, heads of 32) with the soft-cap's ``score_mod`` after ``t5``'s and QK-norm:
    eager's numbers (~20 s a compile)."""
    wide = dict(hidden_size=64, num_attention_heads=2) if family == "bert" else dict(n_embd=64, n_head=2)
    options = dict(use_qk_norm=True, attn_logit_softcapping=1.0, **wide)
    ids = random_ids(2, 12)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 9:] = 0
    attention_backends.clear_flex_compile_cache()
    outputs, regions = {}, []
    for attn in ("eager", "flex_attention"):
        model = make_model(family, "t5", attn=attn, **options)
        with torch.no_grad():
            outputs[attn] = model(ids, attention_mask=attention_mask).logits
        regions = [name for _, name in attention_backends._FIRST_SHAPES]
    assert regions == ["t5+softmax+softcap"]
    visible = attention_mask.bool()
    torch.testing.assert_close(outputs["flex_attention"][visible], outputs["eager"][visible], atol=1e-5, rtol=1e-4)


def test_a_model_with_the_options_loads_as_remote_code_without_hf_posenc(tmp_path):
    """The QK-norm module, the soft-cap and the canon layers live in the modules a saved folder carries: a folder of
    each family, loaded in one process without hf_posenc (the decoder's cached generation equal to the uncached)."""
    ids = random_ids(2, 9)
    arguments, expected = [], {}
    for family in ("bert", "gpt2"):
        options = dict(use_qk_norm=True, attn_logit_softcapping=1.0, canon_layers="ABCD", canon_kernel_size=3)
        model = make_model(family, "rope", attn="sdpa", **options)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.normal_(1.0, 0.5)
            folder = tmp_path / family
            model.save_pretrained(folder)
            torch.save(ids, folder / "ids.pt")
            auto_name = "AutoModelForMaskedLM" if family == "bert" else "AutoModelForCausalLM"
            arguments += [str(folder), auto_name]
            expected[folder / f"{auto_name}.pt"] = model(ids).logits
    command = [sys.executable, "-c", LOAD_WITHOUT_HF_POSENC, *arguments]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for path, logits in expected.items():
        torch.testing.assert_close(torch.load(path), logits, atol=1e-5, rtol=1e-4, msg=str(path))
