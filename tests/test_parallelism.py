"""Tensor, context and sequence parallelism: each catalogue entry runs under it or is refused by name, before any
training; tensor parallelism through Transformers' own plan on two CPU processes over gloo.

The sets below state, independently of the code, which entries the catalogue declares able to run under each
parallelism (``docs/guide.md``'s table says why): tensor parallelism splits the heads, and every entry reads what it
holds per head at its rank's heads and sums over the ranks the gradient of what every head reads (the input-side
schemes run before the heads are split), so every entry runs under it (a retrofitted model refuses differential
attention by the stock plan); context parallelism is torch's ring attention, plain SDPA of softmax(q.k) on blocks of
keys, so only the schemes that change q, k or the input (RoPE, the absolute tables, none) with softmax; sequence
parallelism (Ulysses) wraps a Transformers attention function by name, which the families' own composition is not, so
every model refuses it.
"""

from __future__ import annotations

import os
import re
import socket
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from conftest import make_model
from torch.distributed.tensor.placement_types import _StridedShard
from transformers.distributed import DistributedConfig

import hf_posenc
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.options import PARALLELISMS, resolve_spec
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import rank_heads


# Named one by one, so that an entry added to the catalogue is decided here, not taken in by default.
INPUT_SIDE = {
    "learned", "sinusoidal", "recurrent", "floater", "multiplicative", "hierarchical", "complex_order", "conv"
}  # fmt: skip
SCORE_SIDE = {
    "none", "rope", "xpos", "pope", "t5", "alibi", "kerple", "fire", "fox", "path", "wall", "selective_rope", "grape"
}  # fmt: skip
CONTENT_TERMS = {"shaw", "xlnet", "deberta", "tupe", "cope", "relative_key"}
SUPPORTED = {
    "position_encoding": {
        "tensor": INPUT_SIDE | SCORE_SIDE | CONTENT_TERMS,
        "context": {"learned", "sinusoidal", "none", "rope"},
        "sequence": {"learned", "sinusoidal", "none", "rope"},
    },
    "attention_normalizer": {
        "tensor": {
            "softmax",
            "l2",
            "exp",
            "relu2",
            "swish_l2",
            "sigmoid",
            "ssmax",
            "softpick",
            "stick_breaking",
            "differential",
        },  # fmt: skip
        "context": {"softmax"},
        "sequence": {"softmax"},
    },
}
REGISTRIES = {"position_encoding": POSITION_ENCODINGS, "attention_normalizer": ATTENTION_NORMALIZERS}
ENTRIES = [(kind, name) for kind, registry in REGISTRIES.items() for name in registry]


def model_with(kind: str, name: str) -> transformers.PreTrainedModel:
    """A small PosEnc BERT with the entry (a decoder where it has no encoder form), softmax or RoPE beside it."""
    entry = REGISTRIES[kind][name]
    scheme, normalizer = (name, "softmax") if kind == "position_encoding" else ("rope", name)
    return make_model("bert", scheme, normalizer, is_decoder="encoder" not in entry.families)


@pytest.mark.parametrize("parallelism", list(PARALLELISMS))
@pytest.mark.parametrize(("kind", "name"), ENTRIES)
def test_every_catalogue_entry_runs_or_is_refused_by_name(kind, name, parallelism):
    """The entry's own answer, then the model's: a refusal names the entry, the parallelism and the reason."""
    entry = REGISTRIES[kind][name]
    refusal = entry.parallelism_refusal(resolve_spec(kind, name, REGISTRIES[kind]), parallelism)
    supported = name in SUPPORTED[kind][parallelism]
    assert (refusal is None) == supported, refusal
    model = model_with(kind, name)
    if parallelism == "sequence":  # the family refuses it whatever the entry, and says the entry's reason too
        with pytest.raises(ValueError, match="Ulysses does not wrap") as raised:
            model.check_parallelism(parallelism)
    elif supported:
        model.check_parallelism(parallelism)
        return
    else:
        with pytest.raises(ValueError, match=f"cannot train under {parallelism} parallelism") as raised:
            model.check_parallelism(parallelism)
    if refusal is not None:
        assert f"{kind} {name!r} refuses {PARALLELISMS[parallelism]}: {refusal}" in str(raised.value)
    if parallelism == "context":
        assert model.supports_context_parallel == supported


@pytest.mark.parametrize(
    ("normalizer", "refused"),
    [
        ({"type": "softmax", "sink": "learned"}, {"context": "its sink"}),
        ({"type": "softmax", "sink": 0.0}, {"context": "its sink"}),
        ({"type": "softmax", "toeplitz_gate": True}, {"context": "Toeplitz gate"}),
        ({"type": "softmax", "output_gate": "headwise"}, {}),
        ({"type": "l2", "output_gate": "elementwise"}, {"context": "l2 is not softmax"}),
    ],
)
def test_sinks_and_gates_are_refused_where_they_cannot_run(normalizer, refused):
    model = make_model("bert", "rope", normalizer)
    for parallelism in ("tensor", "context"):
        if parallelism in refused:
            with pytest.raises(ValueError, match=refused[parallelism]):
                model.check_parallelism(parallelism)
        else:
            model.check_parallelism(parallelism)
    assert model.supports_context_parallel == ("context" not in refused)


def test_context_parallelism_refuses_windowed_layers_as_transformers_does():
    """Transformers' own check (``PreTrainedModel.supports_context_parallel``) and the library's agree: a sliding
    layer refuses context parallelism, whatever its scheme."""
    model = make_model("gpt2", "rope", layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    assert not model.supports_context_parallel
    with pytest.raises(ValueError, match=r"layers of type \['sliding_attention'\]"):
        model.check_parallelism("context")
    assert make_model("gpt2", "rope").supports_context_parallel


def test_unknown_parallelism_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"Unknown parallelism 'pipeline'; valid choices: \['tensor', 'context'"):
        make_model("bert", "rope").check_parallelism("pipeline")


def test_gpt2_family_plan_splits_its_conv1d_projections():
    """GPT-2's Conv1D weights are (in, out): c_attn by output columns as three packed parts q|k|v (six, two halves
    each, under differential), c_fc by output columns, both output projections by input rows; weight and bias under
    one rule."""
    layer = "transformer.h.1."
    expected = {
        "attn.c_attn": "conv1d_packed_qkv_colwise",
        "attn.c_proj": "conv1d_rowwise",
        "mlp.c_fc": "conv1d_colwise",
        "mlp.c_proj": "conv1d_rowwise",
    }
    for normalizer, c_attn in (
        ("softmax", "conv1d_packed_qkv_colwise"),
        ("differential", "conv1d_packed_qkv_halves_colwise"),
    ):
        tp_plan = make_model("gpt2", "rope", normalizer)._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]
        rules = {**expected, "attn.c_attn": c_attn}
        for module, style in rules.items():
            assert tp_plan[layer + module] == tp_plan[layer + module + ".weight"] == style
            assert tp_plan[layer + module + ".bias"] == style


def test_conv1d_styles_refuse_other_modules():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for style, split in (("conv1d_packed_qkv_colwise", "columns"), ("conv1d_rowwise", "rows")):
        with pytest.raises(ValueError, match=f"Linear is not a Conv1D: .* along its {split}; use colwise or rowwise"):
            ALL_PARALLEL_STYLES[style].install_forward(torch.nn.Linear(4, 4), mesh=None)


def test_differential_packs_each_half_of_the_heads():
    """Differential attention pairs head h with head h + heads / 2: q, k and v are packed halves (each rank a share
    of each half, bias as weight), the output projection ``rowwise`` as for every normalizer; a learned sink needs no
    rule (it stays whole, each rank reading its heads)."""
    layer = "bert.encoder.layer.1.attention."
    differential = make_model("bert", "rope", "differential")._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]
    assert {name: differential[layer + "self." + name] for name in ("query", "key", "value")} == dict.fromkeys(
        ("query", "key", "value"), "packed_halves_colwise"
    )
    assert differential[layer + "output.dense"] == "rowwise"
    sink = make_model("bert", "rope", {"type": "softmax", "sink": "learned"})
    tp_plan = sink._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]
    assert tp_plan[layer + "self.query"] == "colwise" and not any("sink" in name for name in tp_plan)


@pytest.mark.parametrize(
    ("num_heads", "size", "halves", "expected"),
    [
        (4, 2, False, [(0, 1), (2, 3)]),
        (8, 4, False, [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (4, 2, True, [(0, 2), (1, 3)]),
        (8, 2, True, [(0, 1, 4, 5), (2, 3, 6, 7)]),
    ],
)
def test_each_rank_holds_the_heads_its_projections_give_it(num_heads, size, halves, expected):
    """``colwise`` gives rank r the rows r * rows / size onwards, a contiguous share of the heads; ``packed_colwise``
    (two packed halves) the same share of each half."""
    assert [rank_heads(num_heads, rank, size, halves) for rank in range(size)] == expected
    with pytest.raises(ValueError, match="6 attention heads, in two halves of 3, do not split evenly between 2 ranks"):
        rank_heads(6, 0, 2, halves=True)
    with pytest.raises(ValueError, match="6 attention heads do not split evenly between 4 ranks"):
        rank_heads(6, 0, 4)


def test_bert_family_plan_shards_every_projection_of_the_heads_and_feed_forward():
    tp_plan = make_model("bert", "rope")._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]
    layer = "bert.encoder.layer.1."
    expected = {
        "attention.self.query": "colwise",
        "attention.self.key": "colwise",
        "attention.self.value": "colwise",
        "attention.output.dense": "rowwise",
        "intermediate.dense": "colwise",
        "output.dense": "rowwise",
    }
    assert {name: tp_plan[layer + name] for name in expected} == expected


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_retrofitted_llama_refuses_tensor_parallelism_for_differential_head_pairs():
    """Llama's stock plan shards the heads contiguously, so differential attention's pairs (head h and h + heads / 2)
    would sit on two ranks: refused when the plans are resolved, and at once, before any module changes, when the
    model is already sharded."""
    differential = hf_posenc.retrofit(tiny_llama(), position_encoding="rope", attention_normalizer="differential")
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot train under tensor parallelism: the model refuses"):
        differential._resolve_parallel_plans(DistributedConfig(tp_size=2))
    sharded = tiny_llama()
    sharded._tp_size = 2
    with pytest.raises(ValueError, match="contiguous share of the heads, and attention_normalizer 'differential'"):
        hf_posenc.retrofit(sharded, position_encoding="rope", attention_normalizer="differential")
    assert type(sharded.model.layers[0].self_attn) is transformers.models.llama.modeling_llama.LlamaAttention
    rope = hf_posenc.retrofit(tiny_llama(), position_encoding="rope")
    assert "model.layers.0.self_attn.q_proj" in rope._resolve_parallel_plans(DistributedConfig(tp_size=2))[0]


# Tensor parallelism on two processes: (name, the saved model's builder, its Auto class). The BERT family's masked LM
# and its decoder (the decoder-only stick-breaking), input-side and rotary schemes, normalizers without parameters;
# each kind of per-head parameter read at each rank's heads: a learned sink, SSMax's scales, T5's table, KERPLE's r1
# and r2, FIRE's MLP output (its input layer, c and L read by every head), FoX's gate projection (from the layer's
# whole input), ALiBi's slopes, a fixed sink; Shaw's tables, read by every head; differential attention, whose q, k, v
# are packed halves (each rank holds heads 0 and 2, or 1 and 3), with T5's table at those heads; PoPE's phase bias,
# the Toeplitz and output gates, the content schemes' per-head biases and projections, PaTH's; and retrofitted Llamas
# (grouped-query attention) under Llama's stock plan with RoPE, ALiBi (which crashed at the first forward before its
# slopes were read by rank), T5, and FoX with SSMax; the GPT-2 family, whose Conv1D c_attn is split as packed q|k|v
# (packed halves of each under differential), with RoPE, ALiBi, T5 with differential, and FoX.
TP_CASES = {
    "bert-rope-softmax": (lambda: make_model("bert", "rope", "softmax"), transformers.AutoModelForMaskedLM),
    "bert-learned-l2": (lambda: make_model("bert", "learned", "l2"), transformers.AutoModelForMaskedLM),
    "bert-sinusoidal-softmax_learned_sink": (
        lambda: make_model("bert", "sinusoidal", {"type": "softmax", "sink": "learned"}),
        transformers.AutoModelForMaskedLM,
    ),
    "bert_decoder-none-stick_breaking": (
        lambda: make_model("bert", "none", "stick_breaking", is_decoder=True),
        transformers.AutoModelForCausalLM,
    ),
    "llama-retrofit-rope": (
        lambda: hf_posenc.retrofit(tiny_llama(), position_encoding="rope"),
        transformers.AutoModelForCausalLM,
    ),
    "bert-alibi-softmax": (lambda: make_model("bert", "alibi", "softmax"), transformers.AutoModelForMaskedLM),
    "llama-retrofit-alibi": (
        lambda: hf_posenc.retrofit(tiny_llama(), position_encoding="alibi"),
        transformers.AutoModelForCausalLM,
    ),
    "bert-t5-softmax": (lambda: make_model("bert", "t5", "softmax"), transformers.AutoModelForMaskedLM),
    "bert-kerple-ssmax": (lambda: make_model("bert", "kerple", "ssmax"), transformers.AutoModelForMaskedLM),
    "bert-fire-softmax_fixed_sink": (
        lambda: make_model("bert", "fire", {"type": "softmax", "sink": 0.0}),
        transformers.AutoModelForMaskedLM,
    ),
    "bert-shaw-softmax": (lambda: make_model("bert", "shaw", "softmax"), transformers.AutoModelForMaskedLM),
    "bert_decoder-fox-softmax": (
        lambda: make_model("bert", "fox", "softmax", is_decoder=True),
        transformers.AutoModelForCausalLM,
    ),
    "bert-t5-differential": (lambda: make_model("bert", "t5", "differential"), transformers.AutoModelForMaskedLM),
    "bert-pope-softmax_toeplitz_gate": (
        lambda: make_model("bert", "pope", {"type": "softmax", "toeplitz_gate": True}),
        transformers.AutoModelForMaskedLM,
    ),
    "bert-xlnet-softmax_output_gate_headwise": (
        lambda: make_model("bert", "xlnet", {"type": "softmax", "output_gate": "headwise"}),
        transformers.AutoModelForMaskedLM,
    ),
    "bert-deberta-softmax": (lambda: make_model("bert", "deberta", "softmax"), transformers.AutoModelForMaskedLM),
    "bert-deberta_own_projections-l2_output_gate_elementwise": (
        lambda: make_model(
            "bert", {"type": "deberta", "share_att_key": False}, {"type": "l2", "output_gate": "elementwise"}
        ),
        transformers.AutoModelForMaskedLM,
    ),
    "bert-tupe-softmax": (lambda: make_model("bert", "tupe", "softmax"), transformers.AutoModelForMaskedLM),
    "bert-relative_key-softmax": (
        lambda: make_model("bert", "relative_key", "softmax"),
        transformers.AutoModelForMaskedLM,
    ),
    "bert_decoder-cope-softmax": (
        lambda: make_model("bert", "cope", "softmax", is_decoder=True),
        transformers.AutoModelForCausalLM,
    ),
    "bert_decoder-path_fox-softmax": (
        lambda: make_model("bert", {"type": "path", "forget_gate": True}, "softmax", is_decoder=True),
        transformers.AutoModelForCausalLM,
    ),
    "llama-retrofit-t5": (
        lambda: hf_posenc.retrofit(tiny_llama(), position_encoding="t5"),
        transformers.AutoModelForCausalLM,
    ),
    "llama-retrofit-fox-ssmax": (
        lambda: hf_posenc.retrofit(tiny_llama(), position_encoding="fox", attention_normalizer="ssmax"),
        transformers.AutoModelForCausalLM,
    ),
    "gpt2-rope-softmax": (lambda: make_model("gpt2", "rope", "softmax"), transformers.AutoModelForCausalLM),
    "gpt2-alibi-softmax": (lambda: make_model("gpt2", "alibi", "softmax"), transformers.AutoModelForCausalLM),
    "gpt2-t5-differential": (lambda: make_model("gpt2", "t5", "differential"), transformers.AutoModelForCausalLM),
    "gpt2-fox-softmax": (lambda: make_model("gpt2", "fox", "softmax"), transformers.AutoModelForCausalLM),
    "gpt2-grape_ap_a-softmax": (  # GRAPE-AP's per-head projection and slopes, GRAPE-A's per-head rates and gates
        lambda: make_model("gpt2", [{"type": "grape", "variant": "ap"}, {"type": "grape", "variant": "a"}]),
        transformers.AutoModelForCausalLM,
    ),
}
BATCH = torch.randint(3, 61, (2, 10), generator=torch.Generator().manual_seed(5))
QUERY_WEIGHTS = ("0.attention.self.query.weight", "0.self_attn.q_proj.weight", "0.attn.c_attn.weight")


def local_query_width(model: transformers.PreTrainedModel) -> int:
    """The width of this rank's queries: its rows of an nn.Linear query weight ``(out, in)``, a third of its
    columns of GPT-2's packed q|k|v Conv1D weight ``(in, 3 * out)``."""
    name, weight = next((key, parameter) for key, parameter in model.named_parameters() if key.endswith(QUERY_WEIGHTS))
    local = weight.to_local()
    return local.shape[1] // 3 if name.endswith("c_attn.weight") else local.shape[0]


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient's whole value on every rank. ``_StridedShard(d, sf)`` (a packed projection) cuts ``d`` into ``sf``
    groups and holds one piece of each group, rank after rank: gathered here by hand, as torch 2.11's
    ``full_tensor`` cannot undo it; every other placement through ``full_tensor``."""
    if not isinstance(tensor, torch.distributed.tensor.DTensor):
        return tensor
    (placement,) = tensor.placements
    if not isinstance(placement, _StridedShard):
        return tensor.full_tensor()
    local = tensor.to_local().contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local)
    by_rank = [piece.chunk(placement.split_factor, dim=placement.dim) for piece in pieces]
    groups = range(placement.split_factor)
    return torch.cat([rank_groups[group] for group in groups for rank_groups in by_rank], dim=placement.dim)


def forward_backward(model: transformers.PreTrainedModel) -> dict:
    """One training step's loss, logits and every parameter's gradient (whole tensors, gathered from the shards)."""
    output = model(input_ids=BATCH, labels=BATCH)
    output.loss.backward()
    grads = {name: whole_tensor(parameter.grad) for name, parameter in model.named_parameters()}
    return {"loss": output.loss.detach(), "logits": output.logits.detach(), "grads": grads}


def run_tensor_parallel(rank: int, port: int, root: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    results = {}
    for name, (_, auto) in TP_CASES.items():
        config = DistributedConfig(tp_size=2)
        model = auto.from_pretrained(root / name, distributed_config=config, trust_remote_code=True)
        results[name] = {**forward_backward(model.train()), "local_width": local_query_width(model)}
    if rank == 0:
        torch.save(results, root / "results.pt")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory) -> dict:
    """Every case saved once, loaded by two processes with ``DistributedConfig(tp_size=2)``; rank 0's results."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    for name, (build, _) in TP_CASES.items():
        model = build()
        with torch.no_grad():  # the family inits biases to 0: drawn, a bias split unlike its weight shows
            for key, parameter in model.named_parameters():
                if key.endswith(".bias"):
                    parameter.normal_(0.0, 0.1)
        model.save_pretrained(root / name)
    mp.spawn(run_tensor_parallel, args=(free_port(), root), nprocs=2)
    return {"root": root, **torch.load(root / "results.pt")}


@pytest.mark.parametrize("name", TP_CASES)
def test_tensor_parallel_step_equals_one_process(tensor_parallel, name):
    """Logits, loss and every gradient of a training step equal one process's; each rank held half the heads."""
    folder = tensor_parallel["root"] / name
    result = tensor_parallel[name]
    one = TP_CASES[name][1].from_pretrained(folder, trust_remote_code=True)
    expected = forward_backward(one.train())
    heads = one.config.num_attention_heads
    assert result["local_width"] == one.config.hidden_size // 2 and heads % 2 == 0
    torch.testing.assert_close(result["logits"], expected["logits"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(result["loss"], expected["loss"], atol=1e-6, rtol=1e-5)
    assert result["grads"].keys() == expected["grads"].keys()
    for key, grad in expected["grads"].items():
        torch.testing.assert_close(
            result["grads"][key], grad, atol=1e-5, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.parametrize(
    ("family", "scheme", "sizes", "says"),
    [
        ("gpt2", "alibi", {"cp_size": 2}, "position_encoding 'alibi' refuses context parallelism"),
        ("gpt2", "rope", {"cp_size": 2}, r"set its cp_size to 1\.$"),
        ("bert", "rope", {"tp_size": 2}, r"set its tp_size to 1\.$"),
        ("gpt2", "rope", {"tp_size": 2}, r"set its tp_size to 1\.$"),
        ("gpt2", "rope", {"sp_size": 2}, "Ulysses does not wrap"),
    ],
)
def test_pretrain_recipe_refuses_model_parallelism_before_any_work(family, scheme, sizes, says):
    """The recipe trains data-parallel only: accelerate's ParallelismConfig with tensor, context or sequence
    parallelism is refused by name, with the model's own refusals where it has some."""
    from accelerate.parallelism_config import ParallelismConfig

    from hf_posenc_recipes import pretrain as pretrain_recipe

    accelerator = types.SimpleNamespace(parallelism_config=ParallelismConfig(**sizes))
    parallelism = {"tp_size": "tensor", "cp_size": "context", "sp_size": "sequence"}[next(iter(sizes))]
    with pytest.raises(ValueError, match=f"{parallelism} parallelism from accelerate's ParallelismConfig") as raised:
        pretrain_recipe.refuse_model_parallelism(accelerator, make_model(family, scheme))
    assert re.search(says, str(raised.value))
    no_parallelism = types.SimpleNamespace(parallelism_config=None)
    pretrain_recipe.refuse_model_parallelism(no_parallelism, make_model(family, scheme))
