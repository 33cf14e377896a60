"""BERT's relative_key / relative_key_query (Transformers 4.x): the layer term against a hand loop of 4.x's
formula, and ``convert`` of a 4.x checkpoint folder against a hand-written copy of 4.x's BertModel forward."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from conftest import make_model, random_ids
from safetensors.torch import save_file
from torch.nn import functional as F

import hf_posenc
from hf_posenc.modeling_posenc_common import build_layer_position_term


HEADS, HEAD_DIM = 4, 8


def scheme_and_term(family: str, spec):
    model = make_model(family, spec)
    base = model.base_model
    attention = base.encoder.layer[1].attention.self if family == "bert" else base.h[1].attn
    return base.position_encoding, attention.position_term


@pytest.mark.parametrize("variant", ["key_query", "key"])
@pytest.mark.parametrize(
    ("family", "query_positions", "key_positions", "consecutive"),
    [
        ("bert", [[0, 1, 2, 3, 4]] * 2, [[0, 1, 2, 3, 4, 5, 6]] * 2, True),
        ("gpt2", [[5, 6, 9, 11, 12], [0, 1, 2, 3, 4]], [[0, 1, 2, 3, 5, 6, 9], [0, 0, 0, 0, 0, 1, 2]], False),
    ],
    ids=["consecutive", "given"],
)
def test_score_term_equals_the_loop_of_4x_formula(family, variant, query_positions, key_positions, consecutive):
    """``scaling * (q_i . r[i - j + M - 1] + k_j . r[i - j + M - 1])`` (key: without the k term), per pair: the
    model's consecutive positions (read by runs) and given positions with a gap and cached keys (gathered); values
    and gradients of q, k and the table."""
    encoding, term = scheme_and_term(family, {"type": "relative_key", "variant": variant, "max_positions": 13})
    query_positions, key_positions = torch.tensor(query_positions), torch.tensor(key_positions)
    tables = encoding.prepare(query_positions, key_positions, "eager", consecutive)
    assert ("relative_key_query_starts" in tables) is consecutive
    inputs = {"position": tables, "query_positions": query_positions, "key_positions": key_positions}
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, HEADS, 5, HEAD_DIM, generator=generator, requires_grad=True)
    key = torch.randn(2, HEADS, 7, HEAD_DIM, generator=generator, requires_grad=True)
    table = term.distance_embedding.weight
    assert table.shape == (2 * 13 - 1, HEAD_DIM)
    scaling, grad_output = 0.3, torch.randn(2, HEADS, 5, 7, generator=generator)
    score = term.score_term(query, key, inputs, scaling, None)
    expected = torch.zeros(2, HEADS, 5, 7)
    for b in range(2):
        for i in range(5):
            for j in range(7):
                row = table[int(query_positions[b, i] - key_positions[b, j]) + 13 - 1]
                for h in range(HEADS):
                    position_score = query[b, h, i] @ row
                    if variant == "key_query":
                        position_score = position_score + key[b, h, j] @ row
                    expected[b, h, i, j] = scaling * position_score
    torch.testing.assert_close(score, expected)
    grads = torch.autograd.grad((score * grad_output).sum(), (query, key, table), allow_unused=True)
    expected_grads = torch.autograd.grad((expected * grad_output).sum(), (query, key, table), allow_unused=True)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert (actual is None) is (wanted is None)  # key: k has no position term
        if wanted is not None:
            torch.testing.assert_close(actual, wanted)


def test_a_distance_past_the_table_raises_naming_the_limit():
    model = make_model("bert", {"type": "relative_key", "max_positions": 6})
    model(random_ids(1, 6))  # distances up to 5 = max_positions - 1
    with pytest.raises(ValueError, match=r"6 positions apart; its distance table reaches 5 \(max_positions=6"):
        model(random_ids(1, 7))


def test_options_defaults_and_refusals():
    spec = hf_posenc.PosEncBertConfig(position_encoding="relative_key", max_position_embeddings=24).position_encoding
    assert spec == {"type": "relative_key", "variant": "key_query", "max_positions": 24}
    entry = hf_posenc.list_position_encodings()["relative_key"]
    assert entry["relative"] and entry["families"] == ["encoder", "decoder"]
    with pytest.raises(ValueError, match=r"option 'variant'='query' is out of range; valid: 'key_query' or 'key'"):
        hf_posenc.PosEncBertConfig(position_encoding={"type": "relative_key", "variant": "query"})
    first, second = (build_layer_position_term(make_model("bert", "relative_key").config, False, i) for i in (0, 1))
    assert first.distance_embedding.weight is not second.distance_embedding.weight


# ---- convert() of a Transformers 4.x checkpoint ----

MAX_POSITIONS, LAYERS, HIDDEN = 16, 2, 32


def write_4x_checkpoint(folder, model_type: str, position_embedding_type: str) -> dict[str, torch.Tensor]:
    """A tiny BertModel / RobertaModel folder as Transformers 4.x saved it with ``position_embedding_type``: its
    config field, per-layer ``encoder.layer.<i>.attention.self.distance_embedding.weight`` and the absolute table
    4.x builds but never adds for a relative type (random here, so using it would show)."""
    config_class, model_class = (
        (transformers.BertConfig, transformers.BertModel)
        if model_type == "bert"
        else (transformers.RobertaConfig, transformers.RobertaModel)
    )
    config = config_class(
        vocab_size=61, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=48,
        max_position_embeddings=MAX_POSITIONS, pad_token_id=1, position_embedding_type=position_embedding_type,
        architectures=[model_class.__name__], initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    state = {name: tensor.contiguous() for name, tensor in model_class(config).state_dict().items()}
    for layer in range(LAYERS):
        table = torch.randn(2 * MAX_POSITIONS - 1, HIDDEN // HEADS) * 0.5
        state[f"encoder.layer.{layer}.attention.self.distance_embedding.weight"] = table
    state["embeddings.position_ids"] = torch.arange(MAX_POSITIONS)[None]  # a persistent buffer of 4.x
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["position_embedding_type"] == position_embedding_type
    return state


def bert_4x_relative_forward(state, ids, attention_mask, key_query: bool, eps: float) -> torch.Tensor:
    """4.x ``BertModel``'s last hidden state for ``relative_key(_query)``, written out: word + token-type embeddings
    (no absolute positions), then per layer 4.x ``BertSelfAttention``'s scores
    ``(q k^T + einsum("bhld,lrd->bhlr", q, r) [+ einsum("bhrd,lrd->bhlr", k, r)]) / sqrt(d)`` with ``r =
    distance_embedding(l - r + max_position_embeddings - 1)`` over local indices, plus the additive padding mask,
    softmax, and BERT's output, intermediate (gelu) and LayerNorm blocks."""

    def linear(x, name):
        return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]

    def layer_norm(x, name):
        return F.layer_norm(x, (HIDDEN,), state[f"{name}.weight"], state[f"{name}.bias"], eps)

    batch, n = ids.shape
    x = state["embeddings.word_embeddings.weight"][ids] + state["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, "embeddings.LayerNorm")
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    additive = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for layer in range(LAYERS):
        prefix = f"encoder.layer.{layer}."
        q, k, v = (
            linear(x, f"{prefix}attention.self.{name}").view(batch, n, HEADS, HEAD_DIM).transpose(1, 2)
            for name in ("query", "key", "value")
        )
        scores = q @ k.transpose(-1, -2)
        positional = state[f"{prefix}attention.self.distance_embedding.weight"][distance + MAX_POSITIONS - 1]
        scores = scores + torch.einsum("bhld,lrd->bhlr", q, positional)
        if key_query:
            scores = scores + torch.einsum("bhrd,lrd->bhlr", k, positional)
        probs = (scores / math.sqrt(HEAD_DIM) + additive).softmax(-1)
        context = (probs @ v).transpose(1, 2).reshape(batch, n, HIDDEN)
        x = layer_norm(linear(context, f"{prefix}attention.output.dense") + x, f"{prefix}attention.output.LayerNorm")
        intermediate = F.gelu(linear(x, f"{prefix}intermediate.dense"))
        x = layer_norm(linear(intermediate, f"{prefix}output.dense") + x, f"{prefix}output.LayerNorm")
    return x


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
@pytest.mark.parametrize("position_embedding_type", ["relative_key_query", "relative_key"])
def test_convert_of_a_4x_relative_checkpoint_gives_4x_outputs(tmp_path, model_type, position_embedding_type):
    state = write_4x_checkpoint(tmp_path, model_type, position_embedding_type)
    converted = hf_posenc.convert(tmp_path).eval()
    assert type(converted) is hf_posenc.PosEncBertModel
    variant = "key_query" if position_embedding_type == "relative_key_query" else "key"
    assert converted.config.position_encoding == {
        "type": "relative_key",
        "variant": variant,
        "max_positions": MAX_POSITIONS,
    }
    assert not hasattr(converted.config, "position_embedding_type")
    ids = random_ids(2, MAX_POSITIONS)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 11:] = 0  # right padding
    ids[1, 11:] = 1
    expected = bert_4x_relative_forward(state, ids, attention_mask, variant == "key_query", eps=1e-12)
    with torch.no_grad():
        actual = converted(ids, attention_mask=attention_mask).last_hidden_state
    visible = attention_mask.bool()
    torch.testing.assert_close(actual[visible], expected[visible], atol=1e-5, rtol=0)


def test_convert_refuses_what_it_cannot_honour(tmp_path):
    relative = tmp_path / "relative"
    relative.mkdir()
    write_4x_checkpoint(relative, "bert", "relative_key_query")
    loaded = transformers.BertModel.from_pretrained(relative)  # v5 drops the distance tables
    with pytest.raises(ValueError, match=r"relative_key_query'.* pass convert\(\) the checkpoint folder"):
        hf_posenc.convert(loaded)
    with pytest.raises(ValueError, match=r"retrofit\(\): .*'relative_key_query' .* Use hf_posenc.convert"):
        hf_posenc.retrofit(loaded)
    with pytest.raises(ValueError, match=r"trained with position_encoding .*'relative_key'.* Leave position_encoding"):
        hf_posenc.convert(relative, position_encoding="learned")
    with pytest.raises(ValueError, match=r"'variant': 'key'.* would not compute what it computes"):
        hf_posenc.convert(relative, position_encoding={"type": "relative_key", "variant": "key"})
    other = tmp_path / "other"
    other.mkdir()
    write_4x_checkpoint(other, "bert", "rotary")
    with pytest.raises(ValueError, match=r"position_embedding_type='rotary' .* reads 'absolute' and \['relative_key'"):
        hf_posenc.convert(other)


def test_convert_of_a_4x_relative_checkpoint_to_another_scheme_drops_the_distance_tables(tmp_path):
    write_4x_checkpoint(tmp_path, "bert", "relative_key")
    converted = hf_posenc.convert(tmp_path, position_encoding="rope")
    assert converted.config.position_encoding["type"] == "rope"
    assert not any("distance_embedding" in name for name in converted.state_dict())
