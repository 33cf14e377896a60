"""What a first GPU would show, checked without one: every FlexAttention call the library makes on CUDA (each scheme
and normalizer, default and given positions, encoder and decoder, training and inference) is built and passed
through torch's own checks of the CUDA path: the backward's joint graph through ``validate_joint_graph`` (Triton's
lowering runs it), the ``score_mod`` / ``mask_mod`` subgraphs through inductor's lowering, and the routing limits of
Triton's kernels. Nothing here needs a GPU: the calls are captured on CPU with the CUDA routing and tables."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import ROOT, family_combos, make_model, random_ids
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.graph import GraphLowering
from torch._inductor.kernel.flex.flex_attention import validate_joint_graph
from torch._inductor.kernel.flex.flex_cpu import CppFlexAttentionTemplate
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from hf_posenc import (
    attention_backends,
    modeling_posenc_common,
    posenc_attention,
    position_interface,
    score_bias_encodings,
)
from hf_posenc.attention_normalizers import ATTENTION_NORMALIZERS
from hf_posenc.configuration_posenc import resolve_attention_normalizer, resolve_position_encoding
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import PositionEncoding


CUDA = torch.device("cuda")  # choose_backend is pure logic: the CUDA rules run without a GPU
WIDE = {"bert": dict(hidden_size=32, num_attention_heads=2), "gpt2": dict(n_embd=32, n_head=2)}  # heads of 16
# The calls are recorded once per region (a scheme and normalizer's, the same in every layer): the first layer's
# calls, the same with one layer as with two, so the capture runs one.
ONE_LAYER = {"bert": dict(num_hidden_layers=1), "gpt2": dict(n_layer=1)}


def flex_schemes() -> list[str]:
    return [name for name, scheme in POSITION_ENCODINGS.items() if "flex_attention" in scheme.backends]


def flex_normalizers() -> list[str]:
    return [name for name, normalizer in ATTENTION_NORMALIZERS.items() if "flex_attention" in normalizer.backends]


CASES = family_combos(
    [(scheme, "softmax") for scheme in flex_schemes()]
    + [("t5", normalizer) for normalizer in flex_normalizers() if normalizer != "softmax"]
) + [(family, "t5", {"type": "softmax", "sink": "learned"}) for family in ("bert", "gpt2")]


def gives_score_mod(scheme: str) -> bool:
    entry = POSITION_ENCODINGS[scheme]
    return entry.score_mod is not PositionEncoding.score_mod or entry.has_layer_term


def checked_in_this_family(case: tuple) -> bool:
    """Every scheme with a score_mod in each family (the schemes without one hand FlexAttention only the mask_mod, the
    same for all of them, and nothing of theirs reaches the backward: `learned` stands in); each other normalizer,
    whose passes wrap the score_mod alike in both families, with `t5` in the decoder (both `t5` forms are checked
    under softmax)."""
    family, scheme, normalizer = case
    if normalizer == "softmax":
        return gives_score_mod(scheme) or scheme == "learned"
    return family == "gpt2"


CHECKED_CASES = [case for case in CASES if checked_in_this_family(case)]


def capture_cuda_flex_calls(
    family: str, scheme: str, normalizer: str, training: bool, given_positions: bool, requested: str, monkeypatch
) -> list[tuple]:
    """The FlexAttention calls of one forward (and backward) of a one-layer model with heads of 16, routed and prepared
    as on CUDA: ``choose_backend`` sees a CUDA device, the schemes build the tables they build there (length-sized
    tables compile on Triton), and every call runs FlexAttention uncompiled on CPU. One call per region and pass:
    ``(query, key, value, kwargs)``."""
    calls = {}
    choose = attention_backends.choose_route

    def choose_on_cuda(requested, position_encoding, attention_normalizer, facts):
        return choose(requested, position_encoding, attention_normalizer, dataclasses.replace(facts, device=CUDA))

    def record(query, key, value, *, region, pass_name="", **kwargs):
        calls.setdefault(f"{region}/{pass_name}", (query, key, value, kwargs))
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(modeling_posenc_common, "choose_route", choose_on_cuda)
    for module in (position_interface, attention_backends, score_bias_encodings):  # each holds the function by name
        monkeypatch.setattr(module, "flex_compiles_length_sized_tables", lambda device: True)
    monkeypatch.setattr(posenc_attention, "flex_attend", record)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # CPU flex refuses gradients
    model = make_model(family, scheme, normalizer, attn=requested, **WIDE[family], **ONE_LAYER[family])
    model.train(training)
    ids = random_ids(2, 12)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 9:] = 0
    position_ids = (torch.arange(12) + 3)[None].expand(2, -1) if given_positions else None
    with torch.set_grad_enabled(training):
        loss = model(ids, attention_mask=attention_mask, position_ids=position_ids, labels=ids).loss
        if training:
            loss.backward()
    return list(calls.values())


def structure(value: Any, grad_flags: bool = True) -> Any:
    """What FlexAttention's traced graph depends on in a call argument: a tensor's shape and dtype (and whether it
    requires gradients, with ``grad_flags``: a forward lowered under ``no_grad`` does not depend on it); a function's
    code and, recursively, what it closes over; a number, string or dataclass (``AuxRequest``) itself; another
    object's type (the model's modules, the same in every capture of one combination)."""

    def of(item: Any) -> Any:
        return structure(item, grad_flags)

    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, grad_flags and value.requires_grad)
    if isinstance(value, functools.partial):
        return ("partial", of(value.func), of(value.args), of(value.keywords))
    if callable(value) and hasattr(value, "__code__"):
        cells = tuple(of(cell.cell_contents) for cell in value.__closure__ or ())
        return ("function", value.__code__.co_code, repr(value.__code__.co_consts), cells)
    if isinstance(value, (bool, int, float, str, type(None))) or dataclasses.is_dataclass(value):
        return repr(value)
    if isinstance(value, BlockMask):
        return ("block_mask", value.seq_lengths, value.BLOCK_SIZE, of(value.mask_mod), value.kv_num_blocks.shape)
    if isinstance(value, dict):
        return tuple(sorted((name, of(item)) for name, item in value.items()))
    if isinstance(value, (tuple, list)):
        return tuple(of(item) for item in value)
    return type(value).__name__


def distinct_calls(calls: list[tuple], grad_flags: bool = True) -> list[tuple]:
    """The calls of ``calls`` that differ in structure (:func:`structure` of every argument): the captures of one
    combination repeat the same call (the default routed to flex and flex requested, a layer's passes at two
    positions, training and inference where only gradients differ), and identical calls trace to identical graphs."""
    return list({structure(call, grad_flags): call for call in calls}.values())


def gradients_onto_few_addresses(joint_graph: torch.fx.Graph) -> list[str]:
    """The captured tensors whose gradient the joint graph adds at an index that follows neither the query nor the
    key (Triton: one atomic add per score onto the same few addresses). The joint graph's inputs are ``score, b, h,
    q_idx, kv_idx, grad_score, *captured``; its outputs the gradients of ``score, b, h, q_idx, kv_idx, *captured``."""
    placeholders = [node for node in joint_graph.nodes if node.op == "placeholder"]
    query_or_key = {placeholders[3], placeholders[4]}

    @functools.cache
    def follows(node: torch.fx.Node) -> bool:
        return node in query_or_key or any(follows(source) for source in node.all_input_nodes)

    output = next(node for node in joint_graph.nodes if node.op == "output")
    offenders = []
    for position, gradient in enumerate(output.args[0][5:]):
        if gradient is None:
            continue
        scattered = gradient.target is torch.ops.flex_lib.zeros_and_scatter.default
        if not scattered or not any(follows(index) for index in gradient.args[1]):
            offenders.append(f"captured tensor {position} (gradient {gradient.format_node()})")
    return offenders


def check_backward(problems: list[str], graph_module, example_inputs):
    """An AOT backward compiler that runs Triton lowering's ``validate_joint_graph`` and the one-address check on
    every FlexAttention backward of the graph, then runs the graph as it is."""
    for node in graph_module.graph.nodes:
        if node.target is torch.ops.higher_order.flex_attention_backward:
            joint_graph = getattr(graph_module, node.args[8].target).graph
            try:
                validate_joint_graph(joint_graph)
            except NotImplementedError as error:
                problems.append(str(error).splitlines()[0])
            problems.extend(gradients_onto_few_addresses(joint_graph))
    return boxed_nop(graph_module, example_inputs)


def assert_backward_graphs_build_for_triton(calls: list[tuple]) -> None:
    problems: list[str] = []
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=functools.partial(check_backward, problems))
    compiled = torch.compile(flex_attention, backend=backend, fullgraph=True, dynamic=False)
    for query, key, value, kwargs in calls:
        if kwargs.get("score_mod") is None and "return_aux" not in kwargs:
            continue  # softmax under a mask alone: nothing of the library's in the backward's joint graph
        query, key, value = (t.detach().requires_grad_() for t in (query, key, value))
        output = compiled(query, key, value, **kwargs)
        if isinstance(output, tuple):  # (output, aux): the normalizers also differentiate the log-sum-exp
            output = output[0].sum() + output[1].lse.masked_fill(output[1].lse.isinf(), 0).sum()
        torch.autograd.grad(output.sum(), query)  # the captured tables' own graph was freed by the model's backward
    assert not problems, problems


class Lowered(Exception):
    """Raised where inductor would compile the lowered graph: lowering succeeded."""


def assert_inductor_lowers(calls: list[tuple], monkeypatch) -> None:
    """Every call's ``score_mod`` and ``mask_mod`` lowered by inductor in one graph (CPU lowers these subgraphs as
    Triton's does), stopping before code is compiled. Each lowered subgraph's inner function is run through
    inductor's read/write analysis (every op and index of it evaluated, as Triton's template evaluates it) instead
    of the CPU template's C++ code generation for it, which is CPU-only work: most of a case's time, none of it the
    CUDA path's."""

    if not calls:
        return

    def stop(self, *args, **kwargs):
        raise Lowered

    def evaluate_without_cpp_code(self, subgraph_buffer, output_name, output_idx):
        subgraph_buffer.get_read_writes()
        return ""

    monkeypatch.setattr(GraphLowering, "compile_to_module", stop)
    monkeypatch.setattr(CppFlexAttentionTemplate, "modification", evaluate_without_cpp_code)

    def lowered(kwargs: dict) -> dict:  # CPU lowering refuses the log-sum-exp; the subgraphs lower the same without
        return {name: value for name, value in kwargs.items() if name not in ("return_lse", "return_aux")}

    def all_calls():
        return [flex_attention(q, k, v, **lowered(kwargs)) for q, k, v, kwargs in calls]

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False), pytest.raises(Exception) as raised:
        torch.compile(all_calls, fullgraph=True, dynamic=False)()
    error = raised.value
    while error is not None and not isinstance(error, Lowered):
        error = error.__cause__ or error.__context__
    assert isinstance(error, Lowered), f"inductor could not lower a score_mod or mask_mod: {raised.value}"


@pytest.mark.parametrize(("family", "scheme", "normalizer"), CHECKED_CASES)
def test_cuda_flex_calls_lower_in_inductor_and_their_backward_passes_tritons_checks(
    family, scheme, normalizer, monkeypatch, request
):
    """Inference and training, default and given positions, flex by default or requested. Every call's score_mod and
    mask_mod lower in one inductor graph per case (DeBERTa's ``torch.tensor`` inside its score_mod failed here:
    ``lift_fresh_copy`` cannot be lowered). Each training call's backward joint graph passes ``validate_joint_graph``
    (a captured tensor that needs gradients indexed twice fails it: KERPLE's one table read per pair) and adds each
    captured tensor's gradient at an index that follows the query or the key (FIRE's c and L, TUPE's [CLS] values and
    every per-pair head-indexed parameter failed it)."""
    request.addfinalizer(torch._dynamo.reset)
    captured = {
        training: [
            call
            for requested in ("sdpa", "flex_attention")
            for given_positions in (False, True)
            for call in capture_cuda_flex_calls(
                family, scheme, normalizer, training, given_positions, requested, monkeypatch
            )
        ]
        for training in (False, True)
    }
    assert captured[False] and captured[True], "a flex_attention request reaches FlexAttention on CUDA"
    assert_backward_graphs_build_for_triton(distinct_calls(captured[True]))
    calls = [(q.detach(), k.detach(), v.detach(), kw) for q, k, v, kw in captured[False] + captured[True]]
    assert_inductor_lowers(distinct_calls(calls, grad_flags=False), monkeypatch)


@pytest.mark.parametrize("request_backend", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("head_dim", [8, 15])
def test_cuda_never_sends_heads_narrower_than_triton_takes_to_flex(request_backend, head_dim):
    """Triton's FlexAttention lowering refuses head_dim < 16 (``FLEX_CUDA_MIN_HEAD_DIM``): every scheme and
    normalizer runs SDPA or eager there, trained or not; at 16 the same requests reach flex."""
    for training in (True, False):
        with torch.set_grad_enabled(training):
            for scheme in flex_schemes():
                for normalizer in flex_normalizers():
                    causal = "encoder" not in POSITION_ENCODINGS[scheme].families
                    encoding = resolve_position_encoding(scheme, 64, causal, 64)
                    normalizer_spec = resolve_attention_normalizer(normalizer)
                    choice = attention_backends.choose_backend(
                        request_backend, encoding, normalizer_spec, CUDA, head_dim=head_dim, consecutive=True
                    )
                    assert choice != "flex_attention", (scheme, normalizer, training)
    wide = attention_backends.choose_backend(
        "flex_attention",
        resolve_position_encoding("t5", 64, False, 64),
        resolve_attention_normalizer("l2"),
        CUDA,
        head_dim=attention_backends.FLEX_CUDA_MIN_HEAD_DIM,
    )
    assert wide == "flex_attention"


@pytest.mark.parametrize(
    ("scheme", "consecutive", "expected"),
    [
        ("t5", True, "flex_attention"),  # per-distance table
        ("t5", False, "sdpa"),  # bucket table read per pair at the head: SDPA's dense bias
        ("kerple", False, "sdpa"),
        ("fire", True, "flex_attention"),  # spread tables: per distance, per position, per query
        ("fire", False, "sdpa"),  # reads c, L and its pieces per pair at the head
    ],
)
def test_cuda_trains_a_score_mod_on_flex_only_where_it_spreads_its_gradients(scheme, consecutive, expected):
    family = "gpt2" if scheme == "kerple" else "bert"
    model = make_model(family, scheme, **WIDE[family]).train()
    encoding = model.base_model.position_encoding
    ids = random_ids(2, 16)
    facts = attention_backends.forward_facts(
        encoding, model.get_input_embeddings()(ids), 16, None, False, False, consecutive, None
    )
    facts = dataclasses.replace(facts, device=CUDA)
    route = attention_backends.choose_route("sdpa", encoding.spec, resolve_attention_normalizer("softmax"), facts)
    assert route.backend == expected
    if expected == "sdpa":  # not preferred, and refused where asked for by name
        assert route.preference is None
        refusals = POSITION_ENCODINGS[scheme].backend_refusals(encoding.spec, facts)
        assert "one gradient per score onto a few addresses" in refusals["flex_attention"]
    with torch.no_grad():  # inference reads the parameters per pair freely: no gradient
        facts = attention_backends.forward_facts(
            encoding, model.get_input_embeddings()(ids), 16, None, False, False, consecutive, None
        )
        assert not facts.position_bias_needs_grad


def test_attention_dropout_on_cuda_warns_once_naming_the_slower_backend_and_the_fix(caplog):
    """BERT's and GPT-2's default attention dropout (0.1) keeps FlexAttention out of CUDA training: the normalizers
    then run eager, the learned biases SDPA with a dense bias. One WARNING says so."""
    attention_backends._log.cache_clear()
    encoding = resolve_position_encoding("t5", 64, False, 64)
    with caplog.at_level(logging.WARNING, logger="hf_posenc"):
        for _ in range(3):
            choice = attention_backends.choose_backend(
                "sdpa", encoding, resolve_attention_normalizer("l2"), CUDA, head_dim=64, attention_dropout=True
            )
            assert choice == "eager"
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "eager" in warnings[0] and "attention_probs_dropout_prob=0" in warnings[0] and "attn_pdrop=0" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_posenc"):  # CPU never runs flex in training: nothing to say
        attention_backends.choose_backend(
            "sdpa",
            encoding,
            resolve_attention_normalizer("l2"),
            torch.device("cpu"),
            head_dim=64,
            attention_dropout=True,
        )
    assert not caplog.records


def test_each_region_compiles_static_first_whatever_other_regions_saw(monkeypatch):
    """Dynamo keeps automatic dynamic shapes per code object, not per region: once one region saw two lengths, a new
    region compiled with ``dynamic=None`` starts symbolic. A region's first shapes compile static here; its second
    length compiles symbolic sizes, which its third length reuses (as on CUDA, on CPU tensors: the recording backend
    compiles nothing, so a torch whose CPU template cannot take symbolic sizes runs this too)."""
    monkeypatch.setattr(attention_backends, "FLEX_CPU_COMPILES_SYMBOLIC_SIZES", True)
    attention_backends.clear_flex_compile_cache()
    torch._dynamo.reset()
    compiled = []  # symbolic sizes?, per compilation

    def recording_backend(graph_module, example_inputs):
        values = [node.meta.get("example_value") for node in graph_module.graph.find_nodes(op="placeholder")]
        sizes = [size for value in values if isinstance(value, torch.Tensor) for size in value.shape]
        compiled.append(any(isinstance(size, torch.SymInt) for size in sizes))
        return graph_module.forward

    original_compile = torch.compile

    def compile_recording(function, **kwargs):
        return original_compile(function, **{**kwargs, "backend": recording_backend})

    monkeypatch.setattr(torch, "compile", compile_recording)
    with torch.no_grad():
        for region, lengths in (("first", (16, 24, 32)), ("second", (16, 40, 48))):
            for length in lengths:
                q = torch.randn(1, 2, length, 16)
                posenc_attention.flex_attend(q, q, q, region=region)
    torch._dynamo.reset()
    attention_backends.clear_flex_compile_cache()
    if attention_backends.COMPILE_ISOLATES_RECOMPILES:
        assert compiled == [False, True, False, True]
    else:  # a region's symbolic code object is new: automatic dynamic compiles its first length static, once
        assert compiled == [False, False, True, False, False, True]


CUDA_PROXY = ROOT.parent / "shared" / "tools" / "cuda_proxy.py"
# Representative interpreted cases (family, the tool's selection): a normalizer read from FlexAttention's
# log-sum-exp with two passes and its eps (softpick; t5 with softmax comes with it), Shaw's value term (the band of
# scores, the log-sum-exp and the encoder's tail pass), differential attention (two flex calls over the heads' pairs).
# The whole grid: benchmarks/cuda_interpret_grid.py.
CUDA_PROXY_CASES = [
    ("gpt2", ["--schemes", "t5", "--normalizers", "softpick"]),
    ("gpt2", ["--schemes", "t5", "--normalizers", "differential"]),
    ("bert", ["--schemes", "shaw", "--normalizers", "softmax"]),
]


@pytest.mark.parametrize(("family", "selection"), CUDA_PROXY_CASES)
def test_the_triton_kernels_run_in_the_interpreter_give_eager_numbers(family, selection):
    """``cuda_proxy.py --interpret``: inductor's CUDA Triton code for each FlexAttention the library compiles, forward
    and backward, run in Triton's interpreter on CPU, against eager (loss, every gradient, logits; float32,
    FlexAttention requested). Minutes of interpreter time per case, so opt-in; the full grid and its figures are in
    ``docs/design.md``."""
    if os.environ.get("HF_POSENC_CUDA_PROXY") != "1":
        pytest.skip("opt-in (HF_POSENC_CUDA_PROXY=1): about 1-2 minutes of Triton's interpreter per case")
    if not CUDA_PROXY.is_file():
        pytest.skip(f"needs the project's shared tool {CUDA_PROXY}, which a clone of the repository does not have")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (torch 2.13 pins triton==3.7.1)")
    command = [sys.executable, str(CUDA_PROXY), "--interpret", "--jobs", "1", "--families", family, *selection]
    command += ["--attn", "flex_attention", "--dtype", "float32"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    summary = re.search(r"cuda-proxy: (\d+) passed, (\d+) failed", result.stdout)
    assert summary is not None and result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert int(summary[1]) > 0 and int(summary[2]) == 0, result.stdout[-4000:]
