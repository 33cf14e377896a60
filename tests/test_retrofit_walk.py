"""The walk: every causal LM class of the installed Transformers, built from a tiny config on CPU, and what
``retrofit`` makes of it: the stock model runs / the identity retrofit keeps it (logits within 1e-5 in float32, its
``generate`` gives the stock forward's greedy tokens: :func:`greedy_tokens`) and its ``alibi`` and ``none``
switches generate as their uncached loop with the dynamic and the static cache / it is refused, with the reason,
before anything changes.

The regular suite walks the model types the retrofit is documented to keep or refuse (``KEPT``, ``REFUSED``); the
whole walk, over every model type, runs with ``HF_POSENC_FULL_WALK=1`` and writes the table of
``docs/retrofit_coverage.md`` (``python tests/test_retrofit_walk.py`` prints it)."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
import transformers
from packaging import version
from transformers.models.auto import modeling_auto

import hf_posenc


TINY = dict(
    vocab_size=61,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    head_dim=8,
    max_position_embeddings=64,
    moe_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=16,
    first_k_dense_replace=0,
    n_group=1,
    topk_group=1,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    sliding_window=4,
    swa_head_dim=8,
    rotary_dim=4,
    linear_head_dim=8,
    linear_num_heads=4,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_expand=2,
    mamba_d_ssm=64,
    mamba_chunk_size=16,
)
"""Sizes set where the model type's config has the field (and can set it: not a property without a setter); the
others keep their defaults."""
CONFIG_OVERRIDES = {
    "bamba": dict(attn_layer_indices=[1], num_hidden_layers=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_hidden_layers=2),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=4),
    "kolibri1_1": dict(head_dim=16),
    "zaya": dict(num_experts_per_tok=1),
    # DeepSeek Sparse Attention: the indexer keeps 4 of the walk's 10 tokens, so that its selection shows
    "deepseek_v32": dict(index_topk=4),
    "glm_moe_dsa": dict(index_topk=4),
    "hy_v4": dict(index_topk=4),
    "axk2": dict(index_topk=4),
}
"""Fields a model type's config needs beside :data:`TINY` to build at that size: hybrids whose default pattern has
no attention layer within two layers (two layers, the second attention), layer patterns of other names, a config
check the tiny sizes break (Kolibri's NVFP4 keys need a head size of 16, ZAYA routes to one expert), an indexer's
top-k below the walk's length."""
MAX_PARAMETERS = 2_000_000
"""A config these sizes leave larger (fields of other names) is counted as not tiny, not built."""
GENERATE = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)


@dataclasses.dataclass
class WalkRow:
    model_type: str
    class_name: str
    outcome: str  # "kept", "refused", "stock fails", "not tiny", "fails"
    detail: str


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """``model_type``'s config with the :data:`TINY` sizes it has fields for; one layer of each of its default layer
    types, decoders' ``is_decoder=True`` (BERT-like causal LMs); then ``overrides``."""
    defaults = transformers.AutoConfig.for_model(model_type)
    read_only = read_only_fields(type(defaults))
    values = {name: value for name, value in TINY.items() if hasattr(defaults, name) and name not in read_only}
    if "qk_rope_head_dim" in values:  # MLA: the head sizes are the nope and rope parts, a key head per query head
        if "head_dim" in values:  # the rotary module's size: the rope part (LongCat's default is its own, 64)
            values["head_dim"] = values["qk_rope_head_dim"]
        values["num_key_value_heads"] = values["num_attention_heads"]
    layer_types = getattr(defaults, "layer_types", None)
    if layer_types is not None and "layer_types" not in read_only:
        # each layer type once, in the order of the default pattern (hybrids keep theirs)
        values["layer_types"] = list(dict.fromkeys(layer_types))
        values["num_hidden_layers"] = len(values["layer_types"])
    values.update(CONFIG_OVERRIDES.get(model_type, {}))
    if hasattr(defaults, "is_decoder"):
        values["is_decoder"] = True
    values.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **values, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return config


def read_only_fields(config_class: type) -> set[str]:
    """The fields of a config class computed from others (a property without a setter, or a name its
    ``attribute_map`` sends to one: Falcon-H1's and Bamba's ``layer_types``)."""
    computed = {
        name
        for name in dir(config_class)
        if isinstance(getattr(config_class, name, None), property) and getattr(config_class, name).fset is None
    }
    aliases = getattr(config_class, "attribute_map", {})
    return computed | {alias for alias, target in aliases.items() if target in computed}


def causal_lm_classes() -> dict[str, str]:
    """Model type -> its causal LM class name, for every causal LM of the installed Transformers."""
    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return {kind: name if isinstance(name, str) else name[0] for kind, name in sorted(names.items())}


def first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def walk(model_type: str, **overrides) -> WalkRow:
    """One row of the walk (see the module docstring); ``overrides``: config fields set beside the tiny sizes."""
    class_name = causal_lm_classes()[model_type]
    row = WalkRow(model_type, class_name, "stock fails", "")
    ids = torch.randint(3, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(0))
    try:
        model_class = getattr(transformers, class_name)
        config = tiny_config(model_type, **overrides)
        with torch.device("meta"):
            size = sum(p.numel() for p in model_class(config).parameters())
        if size > MAX_PARAMETERS:
            return dataclasses.replace(row, outcome="not tiny", detail=f"{size:,} parameters")
        torch.manual_seed(0)
        stock = model_class(config).eval()
        with torch.no_grad():
            expected = stock(ids).logits
        tokens = greedy_tokens(stock, ids)
    except Exception as error:  # a stock model that does not build or run from this tiny config
        return dataclasses.replace(row, detail=first_line(error))
    patched = copy.deepcopy(stock)
    try:
        hf_posenc.retrofit(patched)
    except ValueError as error:
        unchanged = [type(m) for m in patched.modules()] == [type(m) for m in stock.modules()]
        unchanged = unchanged and patched.config.to_dict() == stock.config.to_dict()
        outcome = "refused" if unchanged else "fails"
        return dataclasses.replace(row, outcome=outcome, detail=str(error).split(". It takes ")[0])
    except Exception as error:  # anything but a ValueError naming the reason is a failure of the retrofit
        return dataclasses.replace(row, outcome="fails", detail=first_line(error))
    try:
        return checked_row(row, stock, patched, ids, expected, tokens)
    except Exception as error:  # a retrofitted model that does not run: a failure of the walk, reported
        return dataclasses.replace(row, outcome="fails", detail=first_line(error))


def greedy_tokens(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` and :data:`GENERATE`'s count of tokens, each the argmax of the model's forward on the whole sequence
    (no cache, its own default positions), the end-of-sequence tokens excluded as ``min_new_tokens`` excludes them.
    Not the stock ``generate``: it hands RoBERTa-like decoders position ids counted from 0, table rows their forward
    never reads (it counts from ``padding_idx + 1``)."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    with torch.no_grad():
        for _ in range(GENERATE["max_new_tokens"]):
            logits = model(ids, use_cache=False).logits[:, -1].clone()
            logits[:, eos] = float("-inf")
            ids = torch.cat((ids, logits.argmax(-1, keepdim=True)), dim=1)
    return ids


def checked_row(row: WalkRow, stock, patched, ids, expected, tokens) -> WalkRow:
    """The identity retrofit against the stock logits and tokens, the switches against their uncached loop."""
    with torch.no_grad():
        difference = (patched(ids).logits - expected).abs().max().item()
    problems = [] if difference <= 1e-5 else [f"logits differ by {difference:.2g}"]
    if not torch.equal(patched.generate(ids, **GENERATE), tokens):
        problems.append("greedy tokens differ")
    for scheme in ("alibi", "none"):
        switched = hf_posenc.retrofit(copy.deepcopy(stock), scheme)
        uncached = switched.generate(ids, use_cache=False, **GENERATE)
        for cache in (None, "static"):
            if not torch.equal(switched.generate(ids, cache_implementation=cache, **GENERATE), uncached):
                problems.append(f"{scheme} with the {cache or 'dynamic'} cache differs from its uncached loop")
    family = patched.config.position_encoding
    kind = family["type"] if isinstance(family, dict) else "+".join(dict.fromkeys(spec["type"] for spec in family))
    detail = f"own {kind}, logits within {difference:.1g}"
    return dataclasses.replace(row, outcome="fails" if problems else "kept", detail="; ".join(problems) or detail)


KEPT = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "phi3",
    "gemma2",
    "cohere",
    "glm4",
    "granite",
    "exaone4",
    "apertus",
    # hybrids: their linear-attention, Mamba and convolution layers keep their modules and cache layers
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "olmo_hybrid",
    "lara_mini",
    "lfm3",
    # NoPE attention (no rotary module): beside Mamba-2 layers, beside KDA layers (MLA without positions)
    "nemotron_h",
    "kimi_linear",
    "granitemoehybrid",  # Granite 4: NoPE attention by default (position_embedding_type), its rope_parameters unused
    "bamba",
    "jamba",
    # attention beside Mamba-2 in every layer, one cache layer holding both
    "falcon_h1",
    # fused q/k/v (Falcon's multi-query), rotary through the attention interface
    "falcon",
    # attention sinks (the softmax normalizer's learned sink)
    "flint",
    "granite_swa",
    "granitemoe_swa",
    # MLA (a rotary part beside a no-position part of each head): interleaved pairs, complex frequencies, a hybrid
    "deepseek_v3",
    "deepseek_v2",
    "minicpm3",
    "glm4_moe_lite",
    "youtu",
    "bailing_hybrid",
    # DeepSeek Sparse Attention: attention over the keys an indexer selects, the indexer on its own rotary q and k
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v4",
    "axk2",
    # complex frequencies and NoPE layers
    "llama4_text",
    # a rotation by -m theta (rotate_half as cat(x2, -x1)): hf_posenc's rope on the swapped halves
    "nanochat",
    # ALiBi decoders with fused q/k/v projections, as their own alibi (BLOOM counts positions from the mask)
    "bloom",
    "mpt",
    # decoder layers that call their attention with named arguments only (the forward's stash carries the rest)
    "nemotron",
    "stablelm",
    # BERT-like decoders, found by their structure: no token types, no LayerNorm in the embeddings, pre-LN layers,
    # RoBERTa's positions, a task-type table, an encoder calling its layers with named arguments only, BigBird's full
    # attention
    "bert-generation",
    "xlm-roberta-xl",
    "roberta-prelayernorm",
    "ernie",
    "megatron-bert",
    "big_bird",
    # GPT-like decoders with a learned table beside their layers (OPT's offset-2 table in decoder.layers' owner,
    # counted from the attention mask; BioGPT's; GPT-BigCode's wpe and layers in h, multi-query)
    "opt",
    "biogpt",
    "gpt_bigcode",
    # BART-style attention computing its softmax inline, beside the model's own table (XGLM's sinusoidal rows from 2,
    # TrOCR's learned offset-2 table; TrOCR's cross-attention stays as it is)
    "xglm",
    "trocr",
    # a rotary module returning (sin, cos), its config's rotary_dim: the default rotation over that part, interleaved
    "gptj",
    "codegen",
    # attention sinks on some layers (the others get a sink that takes no weight)
    "mimo_v2_flash",
    # embeddings narrower than the layers, projected to them: the position table at the embeddings' width
    "electra",
    "rembert",
    # RoFormer's own rotation (interleaved, the sinusoids its encoder hands down)
    "roformer",
    # GPT-Neo's local layers (attention_layers, window_size) as sliding layers
    "gpt_neo",
]
"""Model types the retrofit keeps, among the starting points researchers use and the shapes the long tail takes (Llama,
Mistral, Qwen2/3, BERT, RoBERTa, GPT-2 are tested in ``test_retrofit.py``)."""
OLDER_THAN_TABLE = version.parse(transformers.__version__) < version.parse("5.25")
"""Whether the installed Transformers is older than the one of docs/retrofit_coverage.md's table, where some stock
models (GPT-J and CodeGen before their move to the attention interface) are another structure."""
REFUSED = {
    "minimax": "cache of its own class",
    "diffllama": "more than once per layer",
    "openai-gpt": "not a decoder with one list of layers",
    "ctrl": "not called on the layer's hidden_states",
    "hrm_text": "one list of layers",
    "doge": "a bias in the mask",  # its dynamic mask of the values, added to the causal mask
}
"""Model types it refuses, and a word of the reason."""


def test_walk_keeps_granite_4_with_rotary_attention():
    row = walk(present("granitemoehybrid"), position_embedding_type="rope")
    assert (row.outcome, row.detail.split(",")[0]) == ("kept", "own rope"), row


def test_walk_refuses_a_position_bias_in_the_stock_mask():
    """Falcon with ``alibi=True`` adds its ALiBi to the mask its base model hands the attention: refused by name (a
    retrofit building its own masks would drop it; the rotary Falcon is kept)."""
    row = walk(present("falcon"), alibi=True)
    if row.outcome == "refused" and "calls the attention interface" in row.detail and OLDER_THAN_TABLE:
        pytest.skip("Falcon's attention calls the attention interface in later Transformers only (refused here so)")
    assert row.outcome == "refused" and "a bias in the mask" in row.detail, row


def test_selected_keys_hide_the_keys_the_indexer_did_not_pick():
    """:func:`with_selected_keys` against a hand-built mask: query i sees key j where j <= i and the indexer picked j;
    a query whose picks are all later keys sees none (its row attends nowhere, as the stock sparse mask leaves it)."""
    select = sys.modules["hf_posenc.retrofit"].with_selected_keys
    positions = torch.arange(4)[None]
    indices = torch.tensor([[[0, 3], [1, 0], [2, 1], [3, 0]]])
    inputs = {"backend": "sdpa", "query_positions": positions, "key_positions": positions, "mask": None}
    selected = select({**inputs, "visible": None, "row_has_key": None}, indices, torch.float32)
    expected = torch.zeros(4, 4, dtype=torch.bool)
    for query, keys in enumerate(indices[0].tolist()):
        for key in keys:
            expected[query, key] = key <= query
    assert torch.equal(selected["visible"][0, 0], expected)
    assert selected["mask"].dtype == torch.bool and torch.equal(selected["mask"][0, 0], expected)
    eager = select({**inputs, "backend": "eager", "visible": None, "row_has_key": None}, indices, torch.float32)
    assert torch.equal(eager["mask"][0, 0] == 0, expected)
    with pytest.raises(ValueError, match="flex_attention"):
        select({**inputs, "backend": "flex_attention", "visible": None, "row_has_key": None}, indices, torch.float32)


def present(model_type: str) -> str:
    if model_type not in causal_lm_classes():
        pytest.skip(f"{model_type} has no causal LM in Transformers {transformers.__version__}")
    return model_type


@pytest.mark.parametrize("model_type", KEPT)
def test_walk_keeps_the_model(model_type):
    row = walk(present(model_type))
    if row.outcome == "refused" and "lets tokens see later ones" in row.detail:
        pytest.skip(f"the stock {model_type} decoder is not causal without a mask here: {row.detail}")
    if row.outcome == "refused" and "calls the attention interface" in row.detail and OLDER_THAN_TABLE:
        pytest.skip(f"the stock {model_type} attention calls the attention interface in later Transformers only")
    assert row.outcome == "kept", row


@pytest.mark.parametrize(("model_type", "reason"), REFUSED.items())
def test_walk_refuses_the_model_by_name_before_any_change(model_type, reason):
    row = walk(present(model_type))
    assert row.outcome == "refused" and reason in row.detail, row


def coverage_table(rows: list[WalkRow]) -> str:
    """The walk as a Markdown table, with the counts."""
    runs = [row for row in rows if row.outcome not in ("stock fails", "not tiny")]
    kept = [row for row in runs if row.outcome == "kept"]
    lines = [
        f"Transformers {transformers.__version__}: {len(rows)} causal LM model types; the stock tiny model runs for "
        f"{len(runs)}; the retrofit keeps {len(kept)} of them ({100 * len(kept) / max(len(runs), 1):.0f} %).",
        "",
        "| model type | class | outcome | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{r.model_type}` | `{r.class_name}` | {r.outcome} | {r.detail.replace('|', '/')} |" for r in rows]
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(
    os.environ.get("HF_POSENC_FULL_WALK") != "1",
    reason="the full walk (every causal LM model type, minutes on CPU) runs with HF_POSENC_FULL_WALK=1",
)
def test_full_walk_has_no_failures():
    """Every model type is kept, refused by name, or its stock tiny model does not run; none is kept wrongly."""
    rows = [walk(model_type) for model_type in causal_lm_classes()]
    table = coverage_table(rows)
    if os.environ.get("HF_POSENC_WALK_TABLE"):
        with open(os.environ["HF_POSENC_WALK_TABLE"], "w") as file:
            file.write(table)
    assert not [row for row in rows if row.outcome == "fails"], table


if __name__ == "__main__":
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    selected = sys.argv[1:] or list(causal_lm_classes())
    all_rows = []
    for model_type in selected:
        all_rows.append(walk(model_type))
        print(all_rows[-1], file=sys.stderr, flush=True)
    print(coverage_table(all_rows))
