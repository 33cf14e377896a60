"""Training-loop properties of every scheme and normalizer: tables never stale after a fused optimizer step,
bf16 autocast, and ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest
import torch
from conftest import COMBOS, SCHEMES, combos_in_turn_by_family, family_combos, make_model, random_ids, supports


FAMILY_SCHEMES = [(family, scheme) for family in ("bert", "gpt2") for scheme in SCHEMES if supports(family, scheme)]
FAMILY_COMBOS = family_combos(COMBOS)


def train_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> None:
    """``steps`` steps of fused AdamW (Transformers' Trainer default), then back to eval."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model.train()
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize(("family", "scheme"), FAMILY_SCHEMES)
def test_evaluate_after_fused_adamw_steps_equals_a_fresh_model(family, scheme):
    """Trainer's loop: evaluate, train, evaluate. Whatever a scheme keeps between forwards (a generated table, a
    compiled kernel, a derived bias) must follow the new weights: the second evaluation equals a model freshly
    loaded with them."""
    model, ids = make_model(family, scheme), random_ids(2, 10)
    with torch.no_grad():
        before = model(ids, labels=ids).loss
    train_steps(model, ids, steps=5)
    fresh = make_model(family, scheme, seed=1)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after, expected = model(ids, labels=ids).loss, fresh(ids, labels=ids).loss
    assert abs(after - before) > 1e-3
    torch.testing.assert_close(after, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("family", "scheme", "normalizer"), FAMILY_COMBOS)
def test_bf16_autocast_forward_and_backward(family, scheme, normalizer):
    model, ids = make_model(family, scheme, normalizer, attn="sdpa"), random_ids(2, 10)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    assert gradients and all(torch.isfinite(g).all() for g in gradients)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast needs a CUDA device; the CPU test above runs")
@pytest.mark.parametrize("scheme", ["recurrent", "floater", "t5", "fire"])
def test_bf16_autocast_forward_and_backward_on_cuda(scheme):
    """The failure seen on an H100: recurrent under CUDA bf16 autocast."""
    model, ids = make_model("gpt2", scheme, attn="sdpa"), random_ids(2, 10)
    model.cuda().train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids.cuda(), labels=ids.cuda()).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# Each combination in one family (the encoder and the decoder in turn): dynamo traces the scheme's and the
# normalizer's code, which the family does not change. floater's solve cannot be traced (a loop of steps per
# position; torchdiffeq's adaptive step control reads tensor values): it raises, tested below.
COMPILE_COMBOS = [combo for combo in combos_in_turn_by_family(COMBOS) if combo[1] != "floater"]
# Under compile recurrent unrolls max_position_embeddings steps: a short table keeps the trace short.
SHORT_TABLE = {"bert": {"max_position_embeddings": 16}, "gpt2": {"n_positions": 16}}
# Dynamo traces every layer's code again. A single scheme runs the same library lines in one layer as in two (only
# the loop that skips a layer type already seen differs): one layer; a per-layer layout keeps its two.
ONE_LAYER = {"bert": {"num_hidden_layers": 1}, "gpt2": {"n_layer": 1}}


@pytest.mark.parametrize(("family", "scheme", "normalizer"), COMPILE_COMBOS)
def test_fullgraph_compile_traces_every_scheme_and_normalizer(family, scheme, normalizer):
    """``torch.compile(model, fullgraph=True)`` on the default backend request (sdpa, with the library's fallbacks),
    forward and backward of the loss; dynamo only (``backend="eager"``), which is where a graph break shows."""
    layers = {} if isinstance(scheme, list) else ONE_LAYER[family]
    model = make_model(family, scheme, normalizer, attn="sdpa", **SHORT_TABLE[family], **layers)
    ids = random_ids(2, 10)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        expected = model(ids, labels=ids).loss
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fullgraph_compile_of_floater_names_the_reason():
    model, ids = make_model("gpt2", "floater", attn="sdpa"), random_ids(2, 10)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"'floater' cannot be traced by torch.compile\(fullgraph=True\)"):
        torch.compile(model, fullgraph=True, backend="eager")(ids)


def test_compiled_recurrent_table_is_sized_by_max_position_embeddings():
    """Under compile the data cannot size the table: it has max_position_embeddings rows, and a position past them
    fails the index bounds check rather than reading another row."""
    model, ids = make_model("gpt2", "recurrent", attn="sdpa", n_positions=16), random_ids(1, 6)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        with pytest.raises(IndexError, match="out of bounds"):
            compiled(ids, position_ids=torch.arange(12, 18)[None])


def test_inductor_compile_of_a_representative_combination_equals_eager():
    model, ids = make_model("bert", "t5", "l2", attn="sdpa", max_position_embeddings=16), random_ids(2, 10)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
