"""The routing table: for every scheme and normalizer of the registry, on the facts of CPU and CUDA forwards, the
backend ``choose_route`` picks and the sentences that say why the others were refused. The expected backends are
written out here, row by row, from the rule in docs/design.md (not computed by the library's own rule)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hf_posenc import attention_backends
from hf_posenc.attention_backends import choose_route
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import resolve_attention_normalizer
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import ForwardFacts


CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # the choice is pure logic: CUDA facts need no GPU
LAYER_TERMS_ON_FLEX = {"shaw", "xlnet", "deberta", "relative_key", "fox"}
TRAINED_BIASES = {"t5", "kerple", "fire", "tupe"}  # position-only score_mods with parameters (alibi's are fixed)
DENSE_BIASES = TRAINED_BIASES | {"alibi"}
SDPA_NORMALIZERS = {"softmax", "ssmax", "differential", "stick_breaking"}


def spec(name: str) -> dict:
    return {"type": name, **{key: option.default for key, option in POSITION_ENCODINGS[name].options.items()}}


def bert_base_facts(
    device: torch.device, training: bool, length: int, scheme: str = "none", **changes
) -> ForwardFacts:
    """A BERT-base-width forward (12 heads of 64) of ``length`` tokens at the model's default positions."""
    facts = ForwardFacts(
        device,
        torch.bfloat16 if device.type == "cuda" else torch.float32,
        head_dim=64,
        query_length=length,
        key_length=length,
        num_heads=12,
        consecutive=True,
        grad_enabled=training,
        position_bias_needs_grad=training and scheme in TRAINED_BIASES,
    )
    return dataclasses.replace(facts, **changes)


# scheme -> backend of the default request (SDPA) with softmax: CPU training; CUDA training at 2048 tokens; CUDA
# inference at 2048 and at 8192 tokens (a (1, 12, n, n) float32 bias: 192 MiB at 2048, 3072 MiB at 8192)
def expected_default_backends(scheme: str) -> tuple[str, str, str, str]:
    if scheme in LAYER_TERMS_ON_FLEX:
        return ("sdpa", "flex_attention", "flex_attention", "flex_attention")
    if scheme in TRAINED_BIASES:
        return ("sdpa", "flex_attention", "sdpa", "flex_attention")
    if scheme == "alibi":
        return ("sdpa", "sdpa", "sdpa", "flex_attention")
    return ("sdpa", "sdpa", "sdpa", "sdpa")


@pytest.mark.parametrize("scheme", sorted(POSITION_ENCODINGS))
def test_every_scheme_routes_by_the_table_with_softmax(scheme):
    softmax = resolve_attention_normalizer("softmax")
    cases = [
        bert_base_facts(CPU, True, 128, scheme),
        bert_base_facts(CUDA, True, 2048, scheme),
        bert_base_facts(CUDA, False, 2048, scheme),
        bert_base_facts(CUDA, False, 8192, scheme),
    ]
    routes = [choose_route("sdpa", spec(scheme), softmax, facts) for facts in cases]
    assert tuple(route.backend for route in routes) == expected_default_backends(scheme)
    for route in routes:
        if route.backend != "flex_attention" or route.order[0] != "flex_attention":
            continue
        if scheme in LAYER_TERMS_ON_FLEX:
            assert route.preference.startswith("its layer term is a score_mod on FlexAttention")
        elif route is routes[1]:
            assert route.preference.startswith("its position bias trains in the score_mod's backward")
        else:
            assert route.preference == "its dense float bias would take 3072 MiB, over the 256 MiB budget"
    assert choose_route("eager", spec(scheme), softmax, cases[1]).backend == "eager"
    weights = choose_route("sdpa", spec(scheme), softmax, dataclasses.replace(cases[1], need_weights=True))
    assert weights.backend == "eager"
    assert "output_attentions needs the weights, which eager alone materialises" in weights.refusals["sdpa"]


@pytest.mark.parametrize("scheme", sorted(POSITION_ENCODINGS))
def test_a_flex_request_in_cpu_training_is_refused_with_the_sentence(scheme):
    route = choose_route(
        "flex_attention",
        spec(scheme),
        resolve_attention_normalizer("softmax"),
        bert_base_facts(CPU, True, 128, scheme),
    )
    assert route.backend == "sdpa"
    assert any("has no backward" in reason for reason in route.refusals["flex_attention"])


@pytest.mark.parametrize("normalizer", sorted(ATTENTION_NORMALIZERS))
def test_every_normalizer_routes_by_the_table(normalizer):
    """With no position encoding: SDPA where a kernel computes the normalizer, else eager on CPU and flex on CUDA;
    CUDA training with attention dropout leaves flex (eager, or SDPA for those it computes without splitting)."""
    normalizer_spec = resolve_attention_normalizer(normalizer)
    sdpa = normalizer in SDPA_NORMALIZERS
    cpu = choose_route("sdpa", spec("none"), normalizer_spec, bert_base_facts(CPU, True, 128))
    cuda = choose_route("sdpa", spec("none"), normalizer_spec, bert_base_facts(CUDA, True, 2048))
    dropout = choose_route(
        "sdpa", spec("none"), normalizer_spec, bert_base_facts(CUDA, True, 2048, attention_dropout=True)
    )
    assert cpu.backend == ("sdpa" if sdpa else "eager")
    assert cuda.backend == ("sdpa" if sdpa else "flex_attention")
    assert dropout.backend == ("sdpa" if sdpa and normalizer != "differential" else "eager")
    if not sdpa:
        assert cpu.refusals["sdpa"] == (f"{normalizer} does not run on sdpa (no such kernel computes it)",)
        assert (
            cuda.preference == f"SDPA cannot run it ({normalizer} does not run on sdpa (no such kernel computes it))"
        )
        assert dropout.refusals["flex_attention"] == ("FlexAttention has no attention dropout",)
    if normalizer == "differential":
        assert dropout.refusals["sdpa"] == (
            "one SDPA call per value part would draw a dropout mask per part (eager shares one)",
        )


def test_a_value_term_off_its_positions_warns_that_cuda_takes_the_slower_path(caplog):
    """Shaw with given positions on CUDA: its flex path needs consecutive positions, so SDPA runs it with a dense term;
    a WARNING says so, with the refusal sentence."""
    attention_backends._log.cache_clear()
    facts = bert_base_facts(CUDA, True, 2048, "shaw", consecutive=False)
    with caplog.at_level(logging.INFO, logger="hf_posenc"):
        route = choose_route("sdpa", spec("shaw"), resolve_attention_normalizer("softmax"), facts)
    assert route.backend == "sdpa"
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "shaw + softmax runs on sdpa (requested sdpa, FlexAttention first: its layer term" in warnings[0]
    assert "the value term on FlexAttention needs the model's default positions" in warnings[0]


def test_a_block_mask_needs_flex_or_raises():
    facts = bert_base_facts(CPU, False, 128, given_mask="BlockMask")
    assert choose_route("sdpa", spec("t5"), resolve_attention_normalizer("softmax"), facts).backend == "flex_attention"
    with pytest.raises(ValueError, match="A BlockMask attention_mask needs FlexAttention.*returns no log-sum-exp"):
        choose_route("sdpa", spec("t5"), resolve_attention_normalizer("l2"), facts)


def test_forward_facts_are_frozen():
    facts = bert_base_facts(CPU, False, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.query_length = 3
    assert facts.dense_bias_bytes() == 4 * 12 * 16 * 16
