"""Model-level pieces both PosEnc families share: building the scheme and normalizer from a config, the
per-forward attention set-up (backend, mask, position context), and saving as self-contained remote code."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._pytree import tree_flatten, tree_unflatten
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import Conv1D

from .attention_backends import build_attention_mask, build_dense_mask, choose_route, forward_facts
from .attention_normalizers import ATTENTION_NORMALIZERS
from .canon_layers import CanonLayer, canon_forward_inputs
from .configuration_posenc import (
    ATTENTION_LAYER_TYPES,
    config_layer_types,
    layer_position_specs,
    resolve_attention_normalizer,
    resolve_position_layout,
    training_length,
)
from .linear_attention import LINEAR_ATTENTIONS, GatedDeltaNet, linear_keep
from .normalizer_interface import AttentionNormalizer
from .options import ALONG_THE_SEQUENCE, PARALLELISMS, RING_ATTENTION_ONLY
from .posenc_attention import QueryKeyRMSNorm
from .position_encodings import POSITION_ENCODINGS, build_position_encoding_module
from .position_interface import (
    AttentionDims,
    AttentionInputs,
    HeadSharded,
    HeadShare,
    LayerPositionTerm,
    PositionCache,
    PositionEncoding,
    rank_heads,
)
from .score_bias_encodings import refuse_old_t5_table


def attention_dims(config, causal: bool) -> AttentionDims:
    """Sizes from a config; ``head_dim`` is ``hidden_size / num_attention_heads`` unless the config sets it (Llama;
    a retrofit's ``posenc_head_dim`` where the stock attention's heads are not of the config's ``head_dim``); the
    embeddings' width a retrofit's ``posenc_embedding_size`` where they are projected to ``hidden_size``."""
    head_dim = getattr(config, "posenc_head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and config.hidden_size % config.num_attention_heads != 0:
        raise ValueError(
            f"hidden_size ({config.hidden_size}) must be a multiple of num_attention_heads "
            f"({config.num_attention_heads})."
        )
    return AttentionDims(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        head_dim=head_dim or config.hidden_size // config.num_attention_heads,
        max_positions=training_length(config),
        causal=causal,
        num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        embedding_size=getattr(config, "posenc_embedding_size", None),
    )


def input_size(config) -> int:
    """The width of the token embeddings an input-side scheme acts on: ``hidden_size``, or a retrofit's
    ``posenc_embedding_size`` where the stock embeddings are projected to it (ELECTRA, RemBERT)."""
    return getattr(config, "posenc_embedding_size", None) or config.hidden_size


def resolve_config_position_encoding(config, causal: bool) -> dict[str, Any] | list[dict[str, Any]]:
    """``config.position_encoding`` resolved again (a user may have assigned a name, a partial dict or list, or
    ``is_decoder``, after the config was built)."""
    config.position_encoding = resolve_position_layout(
        config.position_encoding,
        config.num_hidden_layers,
        training_length(config),
        causal,
        input_size(config),
    )
    return config.position_encoding


def build_position_encoding(config, causal: bool) -> PositionEncoding:
    """The model's position encoding: one scheme, or a scheme per attention layer (``PerLayerPositionEncoding``)."""
    return build_position_encoding_module(
        resolve_config_position_encoding(config, causal), attention_dims(config, causal)
    )


def build_layer_position_term(config, causal: bool, layer_idx: int) -> LayerPositionTerm | None:
    """The per-layer module of attention layer ``layer_idx``'s scheme (schemes that read the content), or None."""
    specs = layer_position_specs(resolve_config_position_encoding(config, causal), config.num_hidden_layers)
    spec = specs[layer_idx]
    return POSITION_ENCODINGS[spec["type"]].layer_term(spec, attention_dims(config, causal), layer_idx)


def build_query_key_norms(
    config, head_dim: int, eps: float
) -> tuple[QueryKeyRMSNorm, QueryKeyRMSNorm] | tuple[None, None]:
    """An attention layer's QK-norm (``config.use_qk_norm``): the RMSNorms of its queries and of its keys, applied
    per head after the projections and before the position encoding (Qwen3's ``q_norm``, ``k_norm``), or None."""
    if not config.use_qk_norm:
        return None, None
    return QueryKeyRMSNorm(head_dim, eps), QueryKeyRMSNorm(head_dim, eps)


def build_attention_normalizer(config, causal: bool, layer_idx: int) -> AttentionNormalizer:
    """The normalizer of attention layer ``layer_idx``."""
    config.attention_normalizer = resolve_attention_normalizer(config.attention_normalizer, causal)
    spec = config.attention_normalizer
    return ATTENTION_NORMALIZERS[spec["type"]](spec, attention_dims(config, causal), layer_idx)


def resolve_position_ids(
    position_ids: torch.Tensor | None, inputs_embeds: torch.Tensor, past_length: int
) -> torch.Tensor:
    """``(batch|1, seq)`` positions: the given ones (a 1-D ``(seq,)`` tensor serves every row), or by default
    ``past_length .. past_length + seq - 1``."""
    if position_ids is None:
        return torch.arange(past_length, past_length + inputs_embeds.shape[1], device=inputs_embeds.device)[None]
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[-1] != inputs_embeds.shape[1]:
        raise ValueError(
            f"position_ids must be (batch, seq) or (seq,) with seq = {inputs_embeds.shape[1]}; "
            f"got shape {tuple(position_ids.shape)}."
        )
    return position_ids


LayerAttentionInputs = tuple[AttentionInputs, ...]
"""The :data:`AttentionInputs` of each attention layer, in order; layers of one kind (the same scheme and layer type)
share one dict."""


def prepare_attention(
    model,
    encoding: PositionEncoding,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    causal: bool,
    attention_dropout: float,
    cache=None,
    position_cache: PositionCache | None = None,
    output_attentions: bool = False,
    default_positions: bool = False,
    past_length: int | torch.Tensor = 0,
    layer_types: list[str] | None = None,
) -> LayerAttentionInputs:
    """Build what each attention layer reads (:data:`AttentionInputs`), once per forward for each kind of layer: the
    scheme it runs (``encoding.layer_encoding(layer_idx)``) and its type (``config.layer_types``: full, sliding
    window or chunked). Each kind gets the backend that runs it, its mask (the type's mask maker in
    ``masking_utils``, sized as the cache keeps a layer of that type, with the scheme's position bias folded in), the
    positions of its queries and keys (cached keys' from ``position_cache``, as a layer of that type keeps them) and
    its scheme's shared tables. ``default_positions``: the model built ``position_ids`` itself (``arange``); with no
    cached key the positions are then consecutive in every row, which the scheme's ``prepare`` is told (a static
    fact, so no host sync and nothing for ``torch.compile`` to guard on data). With ``config.canon_layers`` every
    kind's inputs also hold ``"canon"`` (:func:`~hf_posenc.canon_layers.canon_forward_inputs`; ``past_length``: the
    tokens cached before this forward). ``layer_types``: the type of each layer where it is not the config's (a
    retrofitted stock layer holding attention beside a recurrent mixer reads the masks of its attention's type)."""
    num_layers = encoding.dims.num_layers
    canon = None
    if getattr(model.config, "canon_layers", None):
        canon = canon_forward_inputs(model, attention_mask, inputs_embeds.shape[1], past_length, position_cache)
    logit_softcapping = getattr(model.config, "attn_logit_softcapping", None)
    layer_schemes = [encoding.layer_encoding(layer_idx) for layer_idx in range(num_layers)]
    all_kinds = list(zip(layer_schemes, layer_types or config_layer_types(model.config), strict=True))
    # linear-attention layers (any layer that is not an attention layer) read no scheme, mask or key position: only
    # which current tokens are padding
    layer_kinds = [(scheme, layer_type) for scheme, layer_type in all_kinds if layer_type in ATTENTION_LAYER_TYPES]
    linear_inputs = None
    if len(layer_kinds) < len(all_kinds):
        linear_inputs = {"linear_keep": linear_keep(attention_mask, inputs_embeds.shape[1], past_length)}
    if causal and isinstance(attention_mask, BlockMask):  # before the cache is touched
        for scheme, _ in layer_kinds:
            refuse_value_term_with_given_block_mask(scheme)
    # Each layer type reads the key positions its cache layers keep: one slot per kind of cache layer, so types whose
    # cache layers keep the same keys (a cache built without the config, or equal windows) store them once.
    key_positions, first_layer, slot_keys = {}, {}, {}
    key_slots = position_cache.key_slots() if position_cache is not None else None
    for layer_idx, (_, layer_type) in enumerate(all_kinds):
        if layer_type in key_positions or layer_type not in ATTENTION_LAYER_TYPES:
            continue
        first_layer[layer_type] = layer_idx
        key_positions[layer_type] = position_ids
        if position_cache is not None:
            slot = key_slots[layer_idx]
            if slot not in slot_keys:
                batch = inputs_embeds.shape[0]
                slot_keys[slot] = position_cache.append_key_positions(position_ids, batch, like=layer_idx)
            key_positions[layer_type] = slot_keys[slot]
    masks: dict[tuple[str, bool, str], Any] = {}

    def kind_inputs(scheme: PositionEncoding, layer_type: str) -> AttentionInputs:
        keys = key_positions[layer_type]
        consecutive = default_positions and keys.shape[-1] == position_ids.shape[-1]
        facts = forward_facts(
            scheme,
            inputs_embeds,
            key_length=keys.shape[-1],
            given_mask=attention_mask,
            need_weights=output_attentions,
            attention_dropout=model.training and attention_dropout > 0,
            consecutive=consecutive,
            logit_softcapping=logit_softcapping,
        )
        requested = model.config._attn_implementation
        backend = choose_route(requested, scheme.spec, model.config.attention_normalizer, facts).backend
        tables = scheme.prepare(position_ids, keys, backend, consecutive=consecutive)
        score_bias = tables.pop("score_bias", None)
        # Nothing masked: a bidirectional layer needs no mask (the bias alone, shared by the batch, is added), nor
        # SDPA without a bias (is_causal covers causality) unless a layer's own term takes the place of the mask.
        allow_skip = not causal or score_bias is None and backend == "sdpa" and not scheme.has_layer_term
        if (backend, allow_skip, layer_type) not in masks:
            masks[backend, allow_skip, layer_type] = build_attention_mask(
                model.config,
                backend,
                causal,
                inputs_embeds,
                attention_mask,
                cache=cache,
                position_ids=position_ids,
                allow_skip=allow_skip,
                layer_type=layer_type,
                layer_idx=None if layer_type == "full_attention" else first_layer[layer_type],
            )
        mask = masks[backend, allow_skip, layer_type]
        inputs = {"backend": backend, "query_positions": position_ids, "key_positions": keys, "position": tables}
        inputs["logit_softcapping"] = logit_softcapping
        if canon is not None:
            inputs["canon"] = canon
        if backend == "flex_attention":
            inputs.update(mask=mask, visible=None, row_has_key=None)
        else:
            dtype = inputs_embeds.dtype
            if backend != "sdpa":
                dtype = torch.promote_types(dtype, torch.float32)
            inputs.update(build_dense_mask(mask, score_bias, dtype, keep_boolean=backend == "sdpa"))
        return inputs

    built: list[tuple[PositionEncoding, str, AttentionInputs]] = []
    for scheme, layer_type in layer_kinds:
        if not any(done is scheme and done_type == layer_type for done, done_type, _ in built):
            built.append((scheme, layer_type, kind_inputs(scheme, layer_type)))
    return tuple(
        linear_inputs
        if layer_type not in ATTENTION_LAYER_TYPES
        else next(inputs for done, done_type, inputs in built if done is scheme and done_type == layer_type)
        for scheme, layer_type in all_kinds
    )


def refuse_value_term_with_given_block_mask(encoding: PositionEncoding) -> None:
    """A decoder's value term on FlexAttention takes its mask to hide every key after the query (the model's causal
    mask does); a ``BlockMask`` given to the model is used as it is, so with a value term it is refused rather than
    trusted to be causal."""
    if encoding.has_value_term(encoding.spec):
        raise ValueError(
            f"{encoding.name}'s value term on FlexAttention in a decoder reads the causal mask; a BlockMask "
            "attention_mask is used as given and may show later keys. Pass a 2-D attention_mask (the model builds "
            "the causal mask) or a 4-D tensor mask (runs SDPA)."
        )


class PositionalLayer(GradientCheckpointingLayer):
    """A Transformer layer that reads the per-forward :data:`AttentionInputs`.

    Called as ``layer(hidden_states, attention_inputs, **kwargs)``; the dict reaches ``forward`` flattened into
    positional arguments (``torch.utils._pytree``), so reentrant activation checkpointing sees, recomputes and
    differentiates through every tensor in it (a position bias shared by all layers included), and unflattened again
    by :meth:`attention_inputs`.
    """

    def __call__(self, hidden_states: torch.Tensor, attention_inputs: AttentionInputs, **kwargs):
        leaves, spec = tree_flatten(attention_inputs)
        return super().__call__(hidden_states, *leaves, attention_spec=spec, **kwargs)

    @staticmethod
    def attention_inputs(leaves: tuple, spec) -> AttentionInputs:
        return tree_unflatten(list(leaves), spec)


def sequence_classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Regression, single- or multi-label loss, chosen by ``config.problem_type`` as Transformers does."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return MSELoss()(logits.squeeze(), labels.squeeze().to(logits.dtype))
    if config.problem_type == "single_label_classification":
        return CrossEntropyLoss()(logits.view(-1, config.num_labels), labels.view(-1))
    return BCEWithLogitsLoss()(logits, labels.to(logits.dtype))


def reject_unsupported_inputs(model, kwargs: dict[str, Any], names: tuple[str, ...]) -> None:
    """Raise on inputs of the stock model that this family does not support, rather than ignore them."""
    given = [name for name in names if kwargs.get(name) is not None]
    if given:
        raise ValueError(f"{type(model).__name__} does not support {given} (no cross-attention in hf_posenc models).")


def check_input_ids(input_ids: torch.Tensor | None) -> None:
    """Raise early on ``input_ids`` that are not token ids (a float tensor would fail deep in ``nn.Embedding``)."""
    if input_ids is not None and input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(
            f"input_ids must hold integer token ids (torch.long or torch.int); got dtype {input_ids.dtype}. "
            "Pass vectors as inputs_embeds instead."
        )


def register_peft_default_targets(
    model_type: str,
    stock_types: tuple[str, ...],
    module_names: Iterable[str] | None = None,
    attention_names: Iterable[str] = (),
) -> None:
    """Give ``model_type`` PEFT's default target modules of the first of ``stock_types`` PEFT has them for, in every
    tuner's table (LoRA's ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``, IA3's, ...), so that
    ``LoraConfig(task_type=...)`` with no ``target_modules`` works as on the stock model.

    PEFT (0.21) finds default targets only in those module-level dicts of ``peft.utils.constants``, keyed by
    ``config.model_type``, with no hook on the model or config; this adds entries to them (it never replaces one) with
    the stock family's module names, which PosEnc and retrofitted models keep (``query``/``value``, ``c_attn``,
    ``q_proj``/``v_proj``). Given the model's ``module_names`` (and its attention modules' ``attention_names``), a
    stock type after the first (a family's, standing in for a type PEFT has no defaults for) is taken only where each
    of its targets names some module and one of them a module of the attention: an MLA attention has no ``q_proj``,
    ``v_proj`` (Bailing's linear-attention layers have them), so it gets none, and LoRA raises PEFT's own error
    asking for ``target_modules``, as on the stock model.
    Does nothing where peft is not installed. Runs when a model is built (``post_init``) or retrofitted, also as
    remote code, so a folder loaded with ``trust_remote_code=True`` gets the defaults without hf_posenc."""
    if importlib.util.find_spec("peft") is None:
        return
    from peft.utils import constants

    leaves = None if module_names is None else {name.rsplit(".", 1)[-1] for name in module_names}
    in_attention = {name.rsplit(".", 1)[-1] for name in attention_names}

    def fits(stock: str, targets) -> bool:
        if leaves is None or stock == stock_types[0] or isinstance(targets, str):
            return True
        return all(target in leaves for target in targets) and any(target in in_attention for target in targets)

    for name, mapping in vars(constants).items():
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MODULES_MAPPING")):
            continue
        source = next((stock for stock in stock_types if stock in mapping and fits(stock, mapping[stock])), None)
        if source is not None and model_type not in mapping:
            mapping[model_type] = copy.copy(mapping[source])


def auto_map_for(config_class: type, model_classes: tuple[type, ...]) -> dict[str, str]:
    """``auto_map`` naming every class of a family by its module file, so a saved folder loads as remote code."""
    entries = {"AutoConfig": f"{config_class.__module__.rsplit('.', 1)[-1]}.{config_class.__name__}"}
    for model_class in model_classes:
        entries[model_class._auto_class] = f"{model_class.__module__.rsplit('.', 1)[-1]}.{model_class.__name__}"
    return entries


def built_class(model: torch.nn.Module) -> type:
    """The class ``model`` was built as. FSDP2's ``fully_shard`` makes a model an instance of ``FSDP<Name>``, a
    subclass of ``(FSDPModule, <Name>)`` that torch defines in its own module."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return next(base for base in type(model).__bases__ if not issubclass(base, FSDPModule))
    return type(model)


SEQUENCE_PARALLEL_ATTENTION = (
    "the attention is hf_posenc's own composition, which Ulysses does not wrap (it replaces a Transformers attention "
    "function registered by name), so each rank would attend only its share of the sequence"
)


CANON_PARALLEL_REFUSALS = {
    "tensor": "their per-channel weights are not sharded with the q/k/v and MLP projections they follow",
    "context": f"their convolution: {ALONG_THE_SEQUENCE}",
    "sequence": f"their convolution: {ALONG_THE_SEQUENCE}",
}
"""Why canon layers (``config.canon_layers``) cannot train under each parallelism."""


def parallelism_refusals(config, parallelism: str, family_refusals: dict[str, str]) -> list[str]:
    """Every reason a model with this config cannot train under ``parallelism`` (a key of ``options.PARALLELISMS``),
    each a sentence naming what refuses it: the family's own (``family_refusals``), each distinct position encoding,
    the normalizer and the linear-attention kind (:meth:`CatalogueEntry.parallelism_refusal`), canon layers
    (:data:`CANON_PARALLEL_REFUSALS`), and for context parallelism any attention layer whose mask is not full or
    causal (torch's ring attention drops it, as Transformers' ``supports_context_parallel`` says)."""
    if parallelism not in PARALLELISMS:
        raise ValueError(f"Unknown parallelism {parallelism!r}; valid choices: {list(PARALLELISMS)}.")
    described = PARALLELISMS[parallelism]
    reasons = (
        [f"the model refuses {described}: {family_refusals[parallelism]}"] if parallelism in family_refusals else []
    )
    specs = layer_position_specs(config.position_encoding, config.num_hidden_layers)
    entries = [(POSITION_ENCODINGS, spec) for spec in specs] + [(ATTENTION_NORMALIZERS, config.attention_normalizer)]
    if getattr(config, "linear_attention", None) is not None:
        entries.append((LINEAR_ATTENTIONS, config.linear_attention))
    seen = []
    for registry, spec in entries:
        if spec in seen:
            continue
        seen.append(spec)
        entry = registry[spec["type"]]
        refusal = entry.parallelism_refusal(spec, parallelism)
        if refusal is not None:
            reasons.append(f"{entry.kind} {spec['type']!r} refuses {described}: {refusal}")
    if getattr(config, "canon_layers", None) and parallelism in CANON_PARALLEL_REFUSALS:
        refusal = CANON_PARALLEL_REFUSALS[parallelism]
        reasons.append(f"canon_layers {config.canon_layers!r} refuse {described}: {refusal}")
    windowed = sorted(
        {kind for kind in config_layer_types(config) if kind in ATTENTION_LAYER_TYPES and kind != "full_attention"}
    )
    if parallelism == "context" and windowed:
        reasons.append(f"layers of type {windowed} refuse {described}: {RING_ATTENTION_ONLY}")
    return reasons


PACKED_HALVES_STYLE = "packed_halves_colwise"
"""The tensor-parallel style of q, k and v under a normalizer that pairs the two halves of the heads: Transformers'
``packed_colwise`` (each rank a share of each half of the weight's rows), with the bias split as its weight."""

CONV1D_COLWISE_STYLE = "conv1d_colwise"
"""``colwise`` for GPT-2's ``Conv1D`` (weight ``(in, out)``): the output columns and the bias split between ranks."""
CONV1D_PACKED_QKV_STYLE = "conv1d_packed_qkv_colwise"
"""GPT-2's fused q/k/v ``Conv1D`` (``c_attn``): its output columns q|k|v as three packed parts, each rank taking its
heads' columns of each part, the bias alike."""
CONV1D_PACKED_QKV_HALVES_STYLE = "conv1d_packed_qkv_halves_colwise"
"""``c_attn`` under a normalizer that pairs the two halves of the heads: q, k and v each as two packed halves (six
parts), each rank taking a share of each half of each."""
CONV1D_ROWWISE_STYLE = "conv1d_rowwise"
"""``rowwise`` for GPT-2's ``Conv1D``: the input rows split between ranks, the bias added once after their sum."""


def refuse_other_than_conv1d(module: torch.nn.Module, split: str) -> None:
    """The Conv1D styles split a weight stored ``(in, out)``; any other module would be split along the wrong dim."""
    if not isinstance(module, Conv1D):
        raise ValueError(
            f"{type(module).__name__} is not a Conv1D: the conv1d tensor-parallel styles split a (in, out) weight "
            f"along its {split}; use colwise or rowwise for nn.Linear."
        )


TRANSFORMERS_TENSOR_PARALLEL_STYLES = torch.distributed.is_available() and (
    importlib.util.find_spec("transformers.distributed.tensor_parallel") is not None
)
"""Whether the installed Transformers has the style registry that the styles above subclass and register into
(``transformers.distributed.tensor_parallel``, as in 5.24; 5.15 keeps an older API in ``transformers.integrations``:
there the styles are not registered, and tensor parallelism of the families is tested on 5.24 only). The styles'
``shard_param`` and ``install_forward`` pass on the keywords 5.25 added (``config``, ``mesh_manager``)."""


if TRANSFORMERS_TENSOR_PARALLEL_STYLES:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.parallel_utils import _use_local_dtensor_params
    from transformers.distributed.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        PackedColwiseParallel,
        RowwiseParallel,
        TensorParallelLayer,
    )

    def distribute_parameter(module: torch.nn.Module, param: str, mesh, placement) -> None:
        """Replace ``module``'s parameter ``param`` by its DTensor over ``mesh`` with ``placement``, as it was
        loaded (no rank broadcasts it), keeping whether it takes gradients."""
        meta = module._parameters[param]
        module._parameters[param] = torch.nn.Parameter(
            distribute_tensor(meta, mesh, [placement], src_data_rank=None), requires_grad=meta.requires_grad
        )

    class PackedHalvesColwiseParallel(PackedColwiseParallel):
        """``packed_colwise`` whose bias is split as its weight (``_StridedShard``: a share of each half).
        Transformers 5.24's ``packed_colwise`` splits a 1-d parameter contiguously, so a bias would load other
        rows than its weight's (found with nonzero q/k/v biases: the logits differ from one process's)."""

        def shard_param(self, module, param, mesh, **kwargs):
            meta = module._parameters.get(param)
            if meta is None or meta.ndim != 1:
                return super().shard_param(module, param, mesh, **kwargs)
            placement = _StridedShard(dim=0, split_factor=self.split_factor)
            distribute_parameter(module, param, mesh, placement)

    ALL_PARALLEL_STYLES.register(PACKED_HALVES_STYLE, PackedHalvesColwiseParallel())

    class Conv1DColwiseParallel(PackedColwiseParallel):
        """``colwise`` (``split_factor`` 1) or ``packed_colwise`` for GPT-2's ``Conv1D``, whose weight is
        ``(in, out)``: the weight split along its output columns (dim 1), the bias alike (dim 0), each rank taking
        its share of each of the ``split_factor`` packed parts. Runs on local tensors, the input's gradient summed
        over the ranks, as ``packed_colwise``."""

        def shard_param(self, module, param, mesh, **kwargs):
            meta = module._parameters.get(param)
            if meta is None:
                return
            dim = meta.ndim - 1
            placement = Shard(dim) if self.split_factor == 1 else _StridedShard(dim, split_factor=self.split_factor)
            distribute_parameter(module, param, mesh, placement)

        def install_forward(self, module, mesh, **kwargs):
            refuse_other_than_conv1d(module, "columns")
            return super().install_forward(module, mesh, **kwargs)

        @contextlib.contextmanager
        def context_around_forward(self, module, mesh):
            """Local parameters, and ``nf`` (by which ``Conv1D`` shapes its output) this rank's columns."""
            full_width = module.nf
            module.nf = module.weight.to_local().shape[1]
            try:
                with super().context_around_forward(module, mesh):
                    yield
            finally:
                module.nf = full_width

    class Conv1DRowwiseParallel(RowwiseParallel):
        """``rowwise`` for GPT-2's ``Conv1D`` (weight ``(in, out)``): the weight split along its input rows (dim 0),
        the input this rank's share of its last dim, the bias whole and added once, after the ranks' partial products
        are summed. Runs on local tensors; ``Conv1D``'s ``addmm`` takes a zero bias during the forward."""

        def should_use_local_tensors(self, module):
            return True

        def shard_param(self, module, param, mesh, **kwargs):
            meta = module._parameters.get(param)
            if meta is None:
                return
            placement = Replicate() if param == "bias" else Shard(0)
            distribute_parameter(module, param, mesh, placement)

        def install_forward(self, module, mesh, **kwargs):
            refuse_other_than_conv1d(module, "rows")
            return TensorParallelLayer.install_forward(self, module, mesh, **kwargs)

        @contextlib.contextmanager
        def context_around_forward(self, module, mesh):
            bias = module._parameters["bias"]
            module._parameters["bias"] = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device)
            try:
                with _use_local_dtensor_params(module):
                    yield
            finally:
                module._parameters["bias"] = bias

    ALL_PARALLEL_STYLES.register(CONV1D_COLWISE_STYLE, Conv1DColwiseParallel(split_factor=1))
    ALL_PARALLEL_STYLES.register(CONV1D_PACKED_QKV_STYLE, Conv1DColwiseParallel(split_factor=3))
    ALL_PARALLEL_STYLES.register(CONV1D_PACKED_QKV_HALVES_STYLE, Conv1DColwiseParallel(split_factor=6))
    ALL_PARALLEL_STYLES.register(CONV1D_ROWWISE_STYLE, Conv1DRowwiseParallel())


def pairs_head_halves(config) -> bool:
    """Whether the config's normalizer works on pairs of heads ``h``, ``h + heads / 2``
    (``AttentionNormalizer.pairs_head_halves``): tensor parallelism then gives each rank a share of each half."""
    return ATTENTION_NORMALIZERS[config.attention_normalizer["type"]].pairs_head_halves


def shard_heads(model: torch.nn.Module) -> None:
    """Under tensor parallelism (Transformers' device mesh set on ``model``): every scheme, layer term and normalizer
    (:class:`~hf_posenc.position_interface.HeadSharded`) computes this rank's heads, those its q, k and v projections
    hold (:func:`~hf_posenc.position_interface.rank_heads`: a contiguous share, or a share of each half of the heads
    for a normalizer that pairs them), and reads its per-head parameters there."""
    mesh_manager = getattr(model, "_mesh_manager", None)
    if mesh_manager is None:
        return
    mesh = mesh_manager.get_mesh("tp")
    num_heads = model.config.num_attention_heads
    heads = rank_heads(num_heads, mesh.get_local_rank(), mesh.size(), pairs_head_halves(model.config))
    share = HeadShare(heads, num_heads, mesh.get_group())
    for module in model.modules():
        if isinstance(module, HeadSharded):
            module.shard_heads(share)


class PosEncPreTrainedMixin:
    """Shared by both families' ``PreTrainedModel``: the init of a scheme's bare parameters
    (``PositionEncoding.init_weights``, ``LayerPositionTerm.init_weights``) and of the normalizers (Toeplitz gate at
    1), full ``auto_map`` on save (the modeling files are copied beside the weights by ``save_pretrained``), the 2-D
    mask kept for ``generate``, and switching ``attn_implementation`` at any time (the backend is chosen at every
    forward)."""

    family_auto_map: dict[str, str] = {}
    family_parallel_refusals: dict[str, str] = {"sequence": SEQUENCE_PARALLEL_ATTENTION}
    """Why the family cannot train under a parallelism of ``options.PARALLELISMS``, whatever its schemes."""
    peft_stock_types: tuple[str, ...] = ()  # the stock model types whose PEFT default targets the family takes

    def post_init(self):
        """Transformers' post-init, then PEFT's default target modules for the model's type
        (:func:`register_peft_default_targets`): when a model is built, since ``get_peft_model`` is given one, rather
        than when the module is imported, so that ``import hf_posenc`` loads no optional package."""
        super().post_init()
        register_peft_default_targets(self.config.model_type, self.peft_stock_types)

    def check_parallelism(self, parallelism: str) -> None:
        """Raise ``ValueError`` with every reason (:func:`parallelism_refusals`) this model cannot train under
        ``parallelism`` (``"tensor"``, ``"context"`` or ``"sequence"``); run by ``from_pretrained`` with a
        tensor-parallel plan and by the recipes before accelerate prepares the model."""
        reasons = parallelism_refusals(self.config, parallelism, self.family_parallel_refusals)
        if reasons:
            raise ValueError(
                f"{type(self).__name__} cannot train under {parallelism} parallelism: " + "; ".join(reasons) + "."
            )

    @property
    def supports_context_parallel(self) -> bool:
        """Transformers' check (no sliding or chunked layer), and no scheme, normalizer or layer that refuses context
        parallelism (:meth:`check_parallelism`): RoPE, no position encoding and the absolute tables, with softmax."""
        return super().supports_context_parallel and not parallelism_refusals(
            self.config, "context", self.family_parallel_refusals
        )

    def _resolve_parallel_plans(self, distributed_config):
        """Transformers' plans, after refusing (by name, before any weight is sharded) a tensor-parallel run that
        a scheme, a normalizer or the family cannot take."""
        if distributed_config.tp_size > 1:
            self.check_parallelism("tensor")
            shard_heads(self)
        return super()._resolve_parallel_plans(distributed_config)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, (PositionEncoding, LayerPositionTerm)):  # after its submodules' default init
            module.init_weights(self.config.initializer_range)
        if isinstance(module, AttentionNormalizer):  # the Toeplitz gate at 1, a learned sink, SSMax's s_h
            module.init_weights(self.config.initializer_range)
        if isinstance(module, CanonLayer):  # nn.Conv1d's default init, as the reference
            module.init_weights()
        if isinstance(module, GatedDeltaNet):  # Qwen3-Next's init: dt_bias ones, A_log = log(U(0.01, 16))
            module.init_weights(self.config.initializer_range)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """Transformers' key adjustments, then a clear error for a ``t5`` table saved in the old layout."""
        super()._adjust_missing_and_unexpected_keys(loading_info)
        refuse_old_t5_table(self, loading_info.unexpected_keys)

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = dict(self.family_auto_map)
        # Transformers copies the module of the model's class beside the weights and names the class in `auto_map`;
        # under FSDP2 that class is torch's `FSDP<Name>`, so the model saves as the class it was built as.
        sharded_class, self.__class__ = type(self), built_class(self)
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__class__ = sharded_class

    def create_masks_for_generate(self, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
        """With a static cache, ``generate`` would build a 4-D mask in the format of the requested backend; hf_posenc
        picks the backend per forward (a decoding step may run another one), so it keeps the 2-D mask and builds the
        4-D one itself, in the format of the backend that runs."""
        return attention_mask

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    @classmethod
    def is_custom_code(cls) -> bool:
        """Transformers skips ``_init_weights`` on parameter-less modules of code it does not know, in case that code
        overwrites loaded weights. Ours initialises only through ``transformers.initialization``, which leaves loaded
        weights alone, and needs the module-level inits (GPT-2's scaled residual init, the l2 W_V/W_O scale)."""
        return False
