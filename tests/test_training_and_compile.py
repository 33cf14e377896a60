"""Training-loop properties of every scheme and normalizer: tables never stale after a fused optimizer step,
bf16 autocast, and ``torch.compile(fullgraph=True)`` (issues 16 and 17)."""

from __future__ import annotations

import pytest
import torch
from conftest import COMBOS, SCHEMES, family_combos, make_model, random_ids, supports


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
