"""GPU training-step benchmark: every scheme and normalizer against stock Transformers and x-transformers, one run.

A training step is the forward and backward of the MLM loss (BERT family) or the LM loss (GPT-2 family) under bf16
autocast, no optimizer. Default model: BERT-base width at half depth (hidden 768, 12 heads, 6 layers, FFN 3072,
vocab 8192, dropout 0), shapes 8 x 2048 and 1 x 8192 (batch x tokens). Rows, per family and shape:

* stock ``BertForMaskedLM`` / ``GPT2LMHeadModel`` on sdpa (the ``x stock`` reference) and hf_posenc's ``none``;
* every position encoding with ``softmax``, and every other normalizer with ``learned``, on the backend the library
  picks (``attn_implementation`` left at its default) and on each other backend requested; each row names the
  backends that actually ran (recorded from the model's own backend choice during the timed steps: a request the
  library routes elsewhere shows as ``flex_attention -> sdpa``);
* with ``--routings new old``, each default row also on the routing before the routing table (:func:`routing`);
* x-transformers' ``Encoder`` / ``Decoder`` with the same schemes where it has them (absolute, alibi, t5, rope),
  when ``x_transformers`` is importable (otherwise a printed note); flash attention except for its T5 bias, which
  x-transformers does not run with flash.

Every row starts from the compile state of a fresh process (dynamo's caches and automatic dynamic shapes reset,
hf_posenc's compiled FlexAttention regions forgotten), so each is timed on the kernels a user's run would get.

Each row: milliseconds per step (median of ``--repeats`` after ``--warmup``; the first calls compile FlexAttention),
the ratio to stock, and peak memory in GiB (CUDA's peak allocated; "-" on CPU). A failure (out of memory, a compile
error) is a row with the error, and the run goes on. The table is printed as markdown, with the device name and the
torch / transformers versions, and written to ``--output``.

    python benchmarks/bench_gpu.py --output bench_gpu.md                      # CUDA, everything (long)
    python benchmarks/bench_gpu.py --schemes none alibi t5 kerple fire --normalizers softmax --shapes 8x2048
    python benchmarks/bench_gpu.py --device cpu --tiny                        # smoke test: tiny model and shapes
    python benchmarks/bench_gpu.py --compile-jobs 8 --time-budget 600 --backends  # a lent GPU's few minutes

``--compile-jobs N`` first runs one step of every row in N processes, so that the timed rows read their kernels from
inductor's on-disk caches; ``--time-budget`` lists the rows not started in time as not run. ``run_on_gpu.sh`` beside
this file is one whole session on a lent GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import bench_common
import torch
import transformers
from bench_common import Size, add_catalogue_argument, print_and_write

import hf_posenc
from hf_posenc import attention_backends, modeling_posenc_common
from hf_posenc.attention_backends import clear_flex_compile_cache
from hf_posenc.position_interface import PositionEncoding
from hf_posenc_recipes.parsers.common import parse_scheme


NORMALIZERS = list(hf_posenc.list_attention_normalizers())
FAMILIES = ["bert", "gpt2"]
BACKENDS = ["sdpa", "flex_attention", "eager"]
# x-transformers' keyword for the same scheme (absolute positions are its default).
X_TRANSFORMERS_SCHEMES = {
    "learned": {},
    "alibi": {"alibi_pos_bias": True},
    "t5": {"rel_pos_bias": True},
    "rope": {"rotary_pos_emb": True},
}


ROUTINGS = ["new", "old"]
OLD_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
"""The kernel options of the routing before the per-pass split: 64 x 64 tiles and one stage for both passes."""


def old_flex_preference(scheme_class, spec, facts) -> str | None:
    """The routing before the routing table: on CUDA a scheme went to FlexAttention by default only for a
    position-only ``score_mod`` whose table takes gradients where they spread (layer terms and fixed or inference-time
    dense biases stayed on SDPA at every length); a normalizer SDPA cannot compute went there as now."""
    trained_bias = scheme_class.score_mod is not PositionEncoding.score_mod and facts.position_bias_needs_grad
    if trained_bias and facts.bias_spreads_gradients:
        return "its position bias trains in the score_mod's backward (old routing)"
    return None


@contextlib.contextmanager
def routing(name: str):
    """``new``: the library as it is; ``old``: :func:`old_flex_preference` and :data:`OLD_KERNEL_OPTIONS` in its
    place while the row is built and timed (kept here only, to time both side by side)."""
    if name not in ROUTINGS:
        raise ValueError(f"routing {name!r}; valid: {ROUTINGS}")
    if name == "new":
        yield
        return
    saved = attention_backends.flex_preference, attention_backends.FLEX_CUDA_KERNEL_OPTIONS
    attention_backends.flex_preference = old_flex_preference
    attention_backends.FLEX_CUDA_KERNEL_OPTIONS = OLD_KERNEL_OPTIONS
    try:
        yield
    finally:
        attention_backends.flex_preference, attention_backends.FLEX_CUDA_KERNEL_OPTIONS = saved


TINY = Size(hidden=32, heads=2, layers=1, ffn=64, vocab=64)


@dataclass
class Row:
    family: str
    shape: str
    model: str
    requested: str
    runs_on: str
    ms: float | None = None
    peak_gib: float | None = None
    error: str = ""


def parse_shape(text: str) -> tuple[int, int]:
    batch, tokens = text.lower().split("x")
    return int(batch), int(tokens)


def architecture(family: str, size: Size, max_len: int) -> dict:
    """The shared stock fields of the shape, without GPT-2's KV cache (a training step builds none)."""
    fields = bench_common.architecture(family, size, max_len)
    if family != "bert":
        fields["use_cache"] = False
    return fields


def posenc_model(family: str, size: Size, max_len: int, scheme: str, normalizer: str, attn: str | None):
    fields = architecture(family, size, max_len)
    fields.update(position_encoding=parse_scheme(scheme), attention_normalizer=normalizer)  # name[:key=value,...]
    if family == "bert":
        config = hf_posenc.PosEncBertConfig(**fields)
        return transformers.AutoModelForMaskedLM.from_config(config, attn_implementation=attn)
    config = hf_posenc.PosEncGPT2Config(**fields)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def stock_model(family: str, size: Size, max_len: int):
    if family == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(**architecture(family, size, max_len)))
    config = transformers.GPT2Config(**architecture(family, size, max_len))
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")


def x_transformers_step(family: str, size: Size, max_len: int, scheme: str) -> Callable:
    """An x-transformers model of the same size with ``scheme``, and its loss (cross-entropy on every token)."""
    from x_transformers import Decoder, Encoder, TransformerWrapper

    layers = (Encoder if family == "bert" else Decoder)(
        dim=size.hidden,
        depth=size.layers,
        heads=size.heads,
        ff_mult=size.ffn // size.hidden,
        attn_flash=scheme != "t5",  # x-transformers asserts that its T5 bias does not run with flash
        **X_TRANSFORMERS_SCHEMES[scheme],
    )
    model = TransformerWrapper(
        num_tokens=size.vocab,
        max_seq_len=max_len,
        attn_layers=layers,
        use_abs_pos_emb=scheme == "learned",
    )

    def loss(ids):
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    return model, loss


def with_loss(make_model: Callable, *args) -> tuple[torch.nn.Module, Callable]:
    """A Transformers model from ``make_model(*args)`` and its loss on ``ids`` (the labels are the ids)."""
    model = make_model(*args)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def measure(loss_of: Callable, ids: torch.Tensor, device: torch.device, warmup: int, repeats: int):
    """Median ms of forward + backward under bf16 autocast, and the peak GiB (CUDA only)."""

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(ids)
        loss.backward()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return (statistics.median(times) if times else None), peak


class BackendRecorder:
    """Records the backends the PosEnc models choose (``modeling_posenc_common.choose_route``) while active."""

    def __init__(self):
        self.seen: set[str] = set()
        self.choose = modeling_posenc_common.choose_route

    def __call__(self, *args, **kwargs) -> attention_backends.Route:
        route = self.choose(*args, **kwargs)
        self.seen.add(route.backend)
        return route

    def __enter__(self):
        self.seen.clear()
        modeling_posenc_common.choose_route = self
        return self

    def __exit__(self, *exc):
        modeling_posenc_common.choose_route = self.choose


def run_row(row: Row, build: Callable, ids, device, args, routing_name: str = "new") -> Row:
    """Time one row from a fresh compile state (with ``routing_name``'s routing); a PosEnc row's ``runs_on`` becomes
    the backends that ran."""
    model = None
    torch._dynamo.reset()
    clear_flex_compile_cache()
    try:
        with routing(routing_name), BackendRecorder() as recorder:
            model, loss_of = build()
            model.to(device).train()
            row.ms, row.peak_gib = measure(loss_of, ids, device, args.warmup, args.repeats)
        if recorder.seen:
            row.runs_on = "+".join(sorted(recorder.seen))
    except Exception as error:  # a row that fails (OOM, compile error) is reported and the run goes on
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(format_row(row, None), flush=True)
    return row


@dataclass(frozen=True)
class Plan:
    """One row to run: what to build (``kind`` stock, posenc or x-transformers) at which shape."""

    family: str
    batch: int
    tokens: int
    kind: str
    scheme: str = ""
    normalizer: str = "softmax"
    requested: str = "default"
    routing: str = "new"

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.tokens}"

    @property
    def model(self) -> str:
        if self.kind == "stock":
            return "stock"
        if self.kind == "x-transformers":
            return f"x-transformers {self.scheme}"
        name = self.scheme if self.normalizer == "softmax" else f"{self.scheme} + {self.normalizer}"
        return name if self.routing == "new" else f"{name} (old routing)"

    def row(self) -> Row:
        # x-transformers runs its T5 bias in its own einsum attention ("eager"), everything else on flash
        x_backend = "eager" if self.scheme == "t5" else "flash"
        backend = {"stock": "sdpa", "x-transformers": x_backend}.get(self.kind, self.requested)
        return Row(self.family, self.shape, self.model, backend, backend if self.kind != "posenc" else "?")

    def build(self, size: Size, max_len: int) -> Callable:
        if self.kind == "stock":
            return partial(with_loss, stock_model, self.family, size, max_len)
        if self.kind == "x-transformers":
            return partial(x_transformers_step, self.family, size, max_len, self.scheme)
        attn = None if self.requested == "default" else self.requested
        return partial(with_loss, posenc_model, self.family, size, max_len, self.scheme, self.normalizer, attn)

    def ids(self, vocab: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (self.batch, self.tokens), generator=generator).to(device)


def cases(args) -> list[tuple[str, str]]:
    combos = [(scheme, "softmax") for scheme in args.schemes]
    combos += [("learned", normalizer) for normalizer in args.normalizers if normalizer != "softmax"]
    return combos


def plans(args, shapes: list[tuple[int, int]], have_x: bool) -> list[Plan]:
    """Every row, shape by shape (the first shape's rows first): stock, then each case on the library's default
    backend and on each explicit request, then x-transformers."""
    planned = []
    for batch, tokens in shapes:
        for family in args.families:
            planned.append(Plan(family, batch, tokens, "stock"))
            side = "decoder" if family == "gpt2" else "encoder"
            for scheme, normalizer in cases(args):
                families = hf_posenc.list_position_encodings()[scheme.partition(":")[0]]["families"]
                normalizer_families = hf_posenc.list_attention_normalizers()[normalizer]["families"]
                if side not in set(families) & set(normalizer_families):
                    continue
                for requested in ["default", *args.backends]:
                    for routing_name in args.routings if requested == "default" else ["new"]:
                        plan = Plan(family, batch, tokens, "posenc", scheme, normalizer, requested, routing_name)
                        planned.append(plan)
            if have_x:
                xs = [s for s in X_TRANSFORMERS_SCHEMES if s in args.schemes]
                planned += [Plan(family, batch, tokens, "x-transformers", s) for s in xs]
    return planned


def allow_many_recompiles() -> None:
    """One process compiles FlexAttention once per scheme, shape and mode: more than dynamo's default limit of 8."""
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096


def compile_row(plan: Plan, size: Size, max_len: int, device: str) -> str:
    """One training step of ``plan``'s model in a worker process: its kernels land in inductor's on-disk caches,
    so the timed run in the main process compiles from them. Returns the error, if any."""
    allow_many_recompiles()
    device = torch.device(device)
    try:
        with routing(plan.routing):
            model, loss_of = plan.build(size, max_len)()
            model.to(device).train()
            measure(loss_of, plan.ids(size.vocab, device), device, warmup=1, repeats=0)
    except Exception as error:
        return f"{plan.model} {plan.shape} {plan.requested}: {type(error).__name__}"
    return ""


def precompile(planned: list[Plan], size: Size, max_len: int, device: torch.device, jobs: int, seconds: float):
    """Run :func:`compile_row` over ``planned`` in ``jobs`` fresh processes for at most ``seconds``."""
    started = time.perf_counter()
    deadline = started + seconds
    context = multiprocessing.get_context("spawn")
    work = partial(compile_row, size=size, max_len=max_len, device=str(device))
    done = 0
    with context.Pool(jobs, maxtasksperchild=1) as pool:
        results = pool.imap_unordered(work, planned)
        try:
            while done < len(planned):
                left = None if math.isinf(deadline) else max(deadline - time.perf_counter(), 0.01)
                error = results.next(timeout=left)
                done += 1
                if error:
                    print(f"precompile: {error}", flush=True)
        except multiprocessing.TimeoutError:
            pool.terminate()
    print(f"precompile: {done} of {len(planned)} rows in {time.perf_counter() - started:.0f} s", flush=True)


def run_plans(planned: list[Plan], size: Size, max_len: int, device: torch.device, args, deadline: float) -> list[Row]:
    """Time each planned row alone; an explicit request for the backend the default already ran is left out, and a
    row not started before ``deadline`` is listed as not run."""
    rows: list[Row] = []
    default_backend: dict[tuple, str] = {}
    for plan in planned:
        key = (plan.family, plan.shape, plan.model)
        if plan.requested != "default" and default_backend.get(key) == plan.requested:
            continue
        row = plan.row()
        if time.perf_counter() > deadline:
            row.error = "not run: --time-budget spent"
            rows.append(row)
            continue
        rows.append(run_row(row, plan.build(size, max_len), plan.ids(size.vocab, device), device, args, plan.routing))
        if plan.kind == "posenc" and plan.requested == "default" and plan.routing == "new":
            default_backend[key] = row.runs_on
    return rows


def format_row(row: Row, stock_ms: float | None) -> str:
    ratio = f"{row.ms / stock_ms:.2f}" if row.ms is not None and stock_ms else "-"
    ms = f"{row.ms:.1f}" if row.ms is not None else "-"
    peak = f"{row.peak_gib:.2f}" if row.peak_gib is not None else "-"
    backend = row.requested if row.runs_on == row.requested else f"{row.requested} -> {row.runs_on}"
    return f"| {row.family} | {row.shape} | {row.model} | {backend} | {ms} | {ratio} | {peak} | {row.error} |"


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and shapes (2x16): a smoke test on CPU")
    parser.add_argument("--shapes", nargs="+", help="batch x tokens, e.g. 8x2048 (default: 8x2048 1x8192)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=FAMILIES)
    schemes_help = "names, or name:key=value,... for a scheme's options (floater:method=rk4)"
    add_catalogue_argument(parser, "--schemes", "position_encoding", schemes_help)
    parser.add_argument("--normalizers", nargs="+", choices=NORMALIZERS, default=NORMALIZERS)
    parser.add_argument(
        "--backends", nargs="*", choices=BACKENDS, default=BACKENDS, help="explicit requests timed (none: --backends)"
    )
    parser.add_argument(
        "--routings",
        nargs="+",
        choices=ROUTINGS,
        default=["new"],
        help="the default request's routings, a row each: new (the library's) and/or old (before the routing table: "
        "layer terms and dense biases on SDPA, one 64x64 one-stage flex tile for both passes)",
    )
    parser.add_argument("--no-x-transformers", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="also write the markdown table here")
    parser.add_argument(
        "--compile-jobs",
        type=int,
        default=0,
        help="first run one step of every row in this many processes, so that the timed rows compile from "
        "inductor's on-disk caches (the rows' kernels are compiled in parallel; the timing stays one row at a time)",
    )
    parser.add_argument("--compile-only", action="store_true", help="with --compile-jobs: compile, time nothing")
    parser.add_argument("--list-rows", action="store_true", help="print the planned rows and stop")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        help="seconds for the whole run (half at most for --compile-jobs): rows not started by then are listed as "
        "not run",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    size = TINY if args.tiny else Size()
    shapes = [parse_shape(s) for s in (args.shapes or (["2x16"] if args.tiny else ["8x2048", "1x8192"]))]
    max_len = max(tokens for _, tokens in shapes)
    allow_many_recompiles()
    have_x = importlib.util.find_spec("x_transformers") is not None and not args.no_x_transformers
    if args.list_rows:
        for plan in plans(args, shapes, have_x):
            print(f"{plan.family} {plan.shape} {plan.model} {plan.requested}")
        return []
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"{device_name}; torch {torch.__version__}, transformers {transformers.__version__}; bf16 autocast, forward + "
        f"backward of the MLM/LM loss; hidden {size.hidden}, {size.heads} heads, {size.layers} layers, FFN "
        f"{size.ffn}, vocab {size.vocab}; median of {args.repeats} after {args.warmup} warm-up steps."
    )
    print(header)
    if not have_x:
        print("note: x_transformers is not importable (or --no-x-transformers): its rows are skipped.")
    started = time.perf_counter()
    planned = plans(args, shapes, have_x)
    if args.compile_jobs:
        seconds = args.time_budget if args.compile_only else args.time_budget / 2
        precompile(planned, size, max_len, device, args.compile_jobs, seconds)
    if args.compile_only:
        return []
    rows = run_plans(planned, size, max_len, device, args, started + args.time_budget)
    stock_ms = {(r.family, r.shape): r.ms for r in rows if r.model == "stock"}
    table = [
        header,
        "",
        "| family | shape | model | backend | ms | x stock | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|",
        *(format_row(row, stock_ms.get((row.family, row.shape))) for row in rows),
    ]
    print_and_write(table, args.output)
    return rows


if __name__ == "__main__":
    main()
