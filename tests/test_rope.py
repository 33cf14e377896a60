"""Rotary position embedding against explicit rotation matrices and transformers' Llama rotary."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model, random_ids
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_posenc.rotary_encodings import apply_rotary, rotary_inverse_frequencies


def rotation_matrix(position: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """R_m built entry by entry: feature i pairs with i + d/2 and turns by m * theta^(-2i/d)."""
    matrix = torch.zeros(dim, dim, dtype=torch.float64)
    half = dim // 2
    for i in range(half):
        angle = position * theta ** (-2 * i / dim)
        matrix[i, i], matrix[i, i + half] = math.cos(angle), -math.sin(angle)
        matrix[i + half, i], matrix[i + half, i + half] = math.sin(angle), math.cos(angle)
    return matrix


def rotate(x: torch.Tensor, position: int, theta: float = 10000.0) -> torch.Tensor:
    dim = x.shape[-1]
    angles = position * rotary_inverse_frequencies(dim, theta)
    return apply_rotary(x[None, None, None], angles.cos()[None, None, None], angles.sin()[None, None, None])[0, 0, 0]


@pytest.mark.parametrize(("m", "n"), [(0, 0), (3, 7), (11, 2), (100, 37)])
def test_rotation_matches_the_explicit_matrix(m, n):
    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, m), rotation_matrix(m, 8) @ x)


@pytest.mark.parametrize(("m", "n"), [(0, 5), (3, 7), (11, 2), (100, 37)])
def test_rotated_dot_product_depends_only_on_the_offset(m, n):
    """<R_m q, R_n k> = <q, R_(n-m) k> (kexue.fm/archives/8130, RoPE)."""
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(rotate(q, m) @ rotate(k, n), q @ rotate(k, n - m))


def test_rotation_matches_transformers_llama():
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    angles = torch.arange(6)[:, None].float() * rotary_inverse_frequencies(8, 10000.0).float()
    cos, sin = angles.cos(), angles.sin()
    llama_q, llama_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    torch.testing.assert_close(apply_rotary(q, cos[None, None], sin[None, None]), llama_q)
    torch.testing.assert_close(apply_rotary(k, cos[None, None], sin[None, None]), llama_k)


def test_rotary_fraction_rotates_only_the_leading_features():
    model = make_model("gpt2", {"type": "rope", "rotary_fraction": 0.5})
    encoding = model.transformer.position_encoding
    assert encoding.rotary_dim == 4  # head_dim 8
    x = torch.randn(1, 1, 3, 8)
    angles = torch.arange(3)[None, None, :, None].float() * rotary_inverse_frequencies(4, 10000.0).float()
    rotated = apply_rotary(x, angles.cos(), angles.sin())
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    torch.testing.assert_close(rotated[0, 0, 2, :4], (rotation_matrix(2, 4).float() @ x[0, 0, 2, :4]))


def test_theta_changes_the_model():
    ids = random_ids(1, 8)
    with torch.no_grad():
        a = make_model("bert", {"type": "rope", "theta": 10000.0})(ids).logits
        b = make_model("bert", {"type": "rope", "theta": 100.0})(ids).logits
    assert (a - b).abs().max() > 1e-4
