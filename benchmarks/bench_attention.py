"""Benchmark PosEnc BERT and GPT-2 models against stock Transformers, measured side by side in one run.

For each family (BERT, GPT-2) and sequence length it times, as a ratio to the stock model on sdpa:

* the stock model on sdpa and eager, and ``hf_posenc.convert(stock)`` (learned + softmax, same weights) on sdpa;
* every position encoding (``--schemes``, default: every registered one) with softmax on sdpa and eager (and on
  flex_attention with ``--flex``), and one training step (forward + backward, no optimizer) of each on sdpa;
* every other attention normalizer (``--normalizers``) with ``learned``, forward and training step, on the backend
  it runs on (a scheme or normalizer may carry options, ``path:forget_gate=true``, ``softmax:output_gate=headwise``);
* each layout of ``--layouts`` (``hf_posenc.LAYOUT_PRESETS``: a scheme and a window per layer) as a scheme row;
* one training step of the stock model, both sdpa.

Besides ``ratio_vs_stock``, each row gives ``ratio_vs_none`` (the ``none`` scheme, same backend and mode, same run)
and, for normalizers, ``ratio_vs_softmax_eager`` and ``ratio_vs_softmax_sdpa`` (``learned`` + softmax, same mode).
``--memory-seq-len 2048`` adds peak training memory per scheme and normalizer at that length, batch 1, each measured
in a fresh process (CUDA: peak allocated; CPU: the resident set's highest growth during one training step, the
kernel's high-water mark), with its ratio to ``none``.

Every model of a family shares the stock weights and sees the same seeded input ids. Timings are medians over
``--repeats`` calls after ``--warmup`` calls (the first one compiles FlexAttention), run round-robin across the
models so that machine drift hits them all alike. Peak memory is reported on CUDA only (the CPU allocator has no
peak counter), so on CPU the table shows latency only.

    python benchmarks/bench_attention.py                          # CPU defaults: about 2 minutes on 2 idle cores
    python benchmarks/bench_attention.py --flex --json bench.json
    python benchmarks/bench_attention.py --families bert --seq-lens 512 --schemes none t5 alibi --memory-seq-len 2048
    python benchmarks/bench_attention.py --device cuda --batch 32 --seq-lens 512 1024 2048
    python benchmarks/bench_attention.py --schemes rope path --layouts irope smollm3 rnope_swa --sliding-window 128 \
        --attention-chunk-size 128 --normalizers softmax softmax:output_gate=elementwise differential
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import transformers
from bench_common import Size, add_catalogue_argument, architecture

import hf_posenc
from hf_posenc_recipes.parsers.common import layout_sizes, parse_scheme


FAMILIES = ["bert", "gpt2"]


@dataclass
class Case:
    family: str
    scheme: str  # "stock" for the unmodified Transformers model
    normalizer: str
    backend: str
    mode: str  # "forward" (no_grad, eval) or "train" (forward + backward)
    model: torch.nn.Module = field(repr=False)
    times: list[float] = field(default_factory=list, repr=False)
    peak_mib: float | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=FAMILIES)
    add_catalogue_argument(
        parser, "--schemes", "position_encoding", "names or name:key=value,...; `none` is always added"
    )
    add_catalogue_argument(parser, "--normalizers", "attention_normalizer", "names or name:key=value,...")
    parser.add_argument("--layouts", nargs="+", choices=list(hf_posenc.LAYOUT_PRESETS), default=[])
    parser.add_argument("--sliding-window", type=int, default=None, help="the window of the --layouts that slide")
    parser.add_argument("--attention-chunk-size", type=int, default=None, help="the chunk of the chunked --layouts")
    parser.add_argument("--memory-seq-len", type=int, default=None, help="also measure peak training memory")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="CPU memory: glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in the measuring processes, e.g. 1048576, so that "
        "freed blocks above it go back to the OS and the resident set follows the live tensors (by default glibc "
        "raises the threshold up to 32 MiB after the first frees and keeps freed heap blocks resident)",
    )
    parser.add_argument("--memory-child", nargs=3, metavar=("FAMILY", "SCHEME", "NORMALIZER"), help=argparse.SUPPRESS)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--flex", action="store_true", help="also time flex_attention (compiles on first call)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="save settings and results as JSON")
    args = parser.parse_args()
    args.schemes = ["none"] + [scheme for scheme in args.schemes if scheme != "none"]
    return args


def layout_values(scheme: str, args: argparse.Namespace) -> dict:
    """The config values of a row: ``position_encoding`` (a spec, or a layout's per-layer list) and a layout's
    windows."""
    if scheme not in hf_posenc.LAYOUT_PRESETS:
        return {"position_encoding": parse_scheme(scheme)}
    return hf_posenc.layout_preset(
        scheme, args.layers, *layout_sizes(scheme, args.sliding_window, args.attention_chunk_size)
    )


def supports(family: str, scheme: str, args: argparse.Namespace) -> bool:
    """Whether the scheme (or every scheme of a layout) has a form for the family; chunked layers: decoders only."""
    values = layout_values(scheme, args)
    if family == "bert" and values.get("attention_chunk_size") is not None:
        return False
    specs = values["position_encoding"]
    kind = "encoder" if family == "bert" else "decoder"
    catalogue = hf_posenc.list_position_encodings()
    return all(kind in catalogue[spec["type"]]["families"] for spec in (specs if isinstance(specs, list) else [specs]))


def normalizer_supports(family: str, normalizer: str) -> bool:
    """Whether the normalizer has a form for the family (``stick_breaking``: decoders only)."""
    families = hf_posenc.list_attention_normalizers()[parse_scheme(normalizer)["type"]]["families"]
    return ("encoder" if family == "bert" else "decoder") in families


def converted(stock, scheme: str, normalizer: str, args: argparse.Namespace) -> transformers.PreTrainedModel:
    """``hf_posenc.convert(stock)`` with the row's scheme (or layout) and normalizer; a layout's windows are set on
    the config and the model rebuilt with the same weights."""
    values = layout_values(scheme, args)
    model = hf_posenc.convert(stock, values.pop("position_encoding"), parse_scheme(normalizer))
    if not values:
        return model
    config = type(model.config).from_dict({**model.config.to_dict(), **values})
    rebuilt = type(model)(config).to(model.device)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt


def stock_model(family: str, args: argparse.Namespace) -> transformers.PreTrainedModel:
    """A randomly initialised stock BertModel / GPT2Model on sdpa, dropout off so train and eval do the same work."""
    max_len = max(args.seq_lens + [args.memory_seq_len or 0])
    size = Size(hidden=args.hidden, heads=args.heads, layers=args.layers, ffn=4 * args.hidden, vocab=args.vocab)
    fields = architecture(family, size, max_len)
    if family == "bert":
        config = transformers.BertConfig(**fields)
    else:
        config = transformers.GPT2Config(**fields, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    return transformers.AutoModel.from_config(config, attn_implementation="sdpa").to(args.device)


def on_backend(model: transformers.PreTrainedModel, backend: str) -> transformers.PreTrainedModel:
    """The same model class and weights, built for another attention backend."""
    if model.config._attn_implementation == backend:
        return model
    config = copy.deepcopy(model.config)  # from_config sets the backend on the config object it is given
    other = transformers.AutoModel.from_config(config, attn_implementation=backend).to(model.device)
    other.load_state_dict(model.state_dict())
    return other


def build_cases(family: str, args: argparse.Namespace) -> list[Case]:
    stock = stock_model(family, args)
    backends = ["sdpa", "eager"] + (["flex_attention"] if args.flex else [])
    cases = []
    for backend in backends:
        if backend != "flex_attention" or type(stock)._supports_flex_attn:  # stock GPT-2 has no flex support
            cases.append(Case(family, "stock", "softmax", backend, "forward", on_backend(stock, backend)))
    for scheme in [s for s in [*args.schemes, *args.layouts] if supports(family, s, args)]:
        model = converted(stock, scheme, "softmax", args)
        for backend in backends:
            cases.append(Case(family, scheme, "softmax", backend, "forward", on_backend(model, backend)))
        cases.append(Case(family, scheme, "softmax", "sdpa", "train", copy.deepcopy(model)))
    for normalizer in [n for n in args.normalizers if normalizer_supports(family, n)]:
        base = converted(stock, "learned", normalizer, args)
        for mode in ("forward", "train"):
            for backend in ("eager", "sdpa") if normalizer == "softmax" else (runs_on(base),):
                if normalizer != "softmax" or not (backend == "sdpa" and "learned" in args.schemes):
                    model = on_backend(copy.deepcopy(base), backend)
                    cases.append(Case(family, "learned", normalizer, backend, mode, model))
    cases.append(Case(family, "stock", "softmax", "sdpa", "train", stock_model(family, args)))
    for case in cases:
        case.model.train(case.mode == "train")
    return cases


def runs_on(model: transformers.PreTrainedModel) -> str:
    """The backend hf_posenc picks for this model when asked for sdpa (with gradients, as in training, on the
    model's default positions)."""
    config = model.config
    specs = config.position_encoding if isinstance(config.position_encoding, list) else [config.position_encoding]
    backends = {
        hf_posenc.attention_backends.choose_backend(
            "sdpa", spec, config.attention_normalizer, model.device, consecutive=True
        )
        for spec in specs
    }
    if len(backends) > 1:
        raise ValueError(f"the layers of {model.config.position_encoding} run on {sorted(backends)}; time one scheme")
    return backends.pop()


def step_fn(case: Case, ids: torch.Tensor) -> Callable[[], None]:
    if case.mode == "forward":

        def forward() -> None:
            with torch.no_grad():
                case.model(input_ids=ids)

        return forward

    def train_step() -> None:
        case.model.zero_grad(set_to_none=True)
        output = case.model(input_ids=ids).last_hidden_state
        output.float().square().mean().backward()

    return train_step


def timed(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def run_cases(cases: list[Case], ids: torch.Tensor, args: argparse.Namespace) -> None:
    """Warm every case up (measuring peak memory on CUDA), then time them round-robin."""
    device = ids.device
    steps = [step_fn(case, ids) for case in cases]
    for case, step in zip(cases, steps, strict=True):
        case.times = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for _ in range(args.warmup):
            timed(step, device)
        if device.type == "cuda":
            case.peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    for _ in range(args.repeats):
        for case, step in zip(cases, steps, strict=True):
            case.times.append(timed(step, device))


def check_cases(cases: list[Case], ids: torch.Tensor) -> None:
    """Guard the comparison: every model runs the backend its row names, and converted learned + softmax computes
    what the stock model computes."""
    for case in cases:
        assert case.model.config._attn_implementation == case.backend, (case, case.model.config._attn_implementation)
    pick = {(c.scheme, c.normalizer, c.backend, c.mode): c.model for c in cases}
    stock, converted = pick["stock", "softmax", "sdpa", "forward"], pick["learned", "softmax", "sdpa", "forward"]
    with torch.no_grad():
        expected, actual = stock(input_ids=ids).last_hidden_state, converted(input_ids=ids).last_hidden_state
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def rows_for(cases: list[Case], seq_len: int) -> list[dict]:
    median = {(c.scheme, c.normalizer, c.backend, c.mode): statistics.median(c.times) for c in cases}
    rows = []
    for case in cases:
        ms = statistics.median(case.times)
        row = {k: v for k, v in asdict(case).items() if k not in ("model", "times")}

        def ratio(scheme: str, normalizer: str, backend: str) -> float | None:
            base = median.get((scheme, normalizer, backend, case.mode))  # noqa: B023 (used within the iteration)
            return None if base is None else ms / base  # noqa: B023

        row.update(seq_len=seq_len, ms=ms, times_ms=case.times)
        row.update(ratio_vs_stock=ratio("stock", "softmax", "sdpa"))
        row.update(ratio_vs_none=ratio("none", "softmax", case.backend))
        if case.scheme == "learned":
            row.update(
                ratio_vs_softmax_eager=ratio("learned", "softmax", "eager"),
                ratio_vs_softmax_sdpa=ratio("learned", "softmax", "sdpa"),
            )
        rows.append(row)
    return rows


def measure_peak_memory(family: str, scheme: str, normalizer: str, args: argparse.Namespace) -> float:
    """Peak memory (MiB) of one training step at ``--memory-seq-len``, batch 1, in this (fresh) process."""
    stock = stock_model(family, args)
    model = converted(stock, scheme, normalizer, args).train()
    model.set_attn_implementation(runs_on(model))
    ids = torch.randint(0, args.vocab, (1, args.memory_seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    step = step_fn(Case(family, scheme, normalizer, "sdpa", "train", model), ids)
    if torch.device(args.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
        base = torch.cuda.memory_allocated(args.device)
        step()
        return (torch.cuda.max_memory_allocated(args.device) - base) / 2**20
    return peak_growth_mib(step)


def status_bytes(field: str) -> int:
    """A size line of ``/proc/self/status`` (``VmRSS``: the resident set; ``VmHWM``: its high-water mark), in bytes."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def peak_growth_mib(fn: Callable[[], None]) -> float:
    """Growth of the resident set over its value before ``fn``, at its highest while ``fn`` runs: the kernel's
    high-water mark (``VmHWM``), reset to the current resident set just before (``echo 5 > /proc/self/clear_refs``,
    Linux >= 4.0). The CPU allocator keeps no peak counter, the process's ``ru_maxrss`` may predate ``fn``, and a
    thread sampling the resident set misses short peaks whenever it is not scheduled (a loaded machine)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    before = status_bytes("VmRSS")
    fn()
    return (status_bytes("VmHWM") - before) / 2**20


def memory_rows(args: argparse.Namespace) -> list[dict]:
    """Peak training memory of every scheme (softmax) and normalizer (learned), each in a fresh process."""
    rows = []
    for family in args.families:
        combos = [(s, "softmax") for s in [*args.schemes, *args.layouts] if supports(family, s, args)]
        combos += [("learned", n) for n in args.normalizers if n != "softmax" and normalizer_supports(family, n)]
        for scheme, normalizer in combos:
            command = [sys.executable, __file__, "--memory-child", family, scheme, normalizer]
            command += ["--memory-seq-len", str(args.memory_seq_len), "--device", args.device, "--seq-lens", "1"]
            command += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads)]
            command += ["--vocab", str(args.vocab), "--seed", str(args.seed)]
            command += ["--sliding-window", str(args.sliding_window)] if args.sliding_window is not None else []
            chunk = args.attention_chunk_size
            command += ["--attention-chunk-size", str(chunk)] if chunk is not None else []
            env = dict(os.environ)
            if args.malloc_mmap_threshold is not None:
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
            result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            peak = float(result.stdout.split()[-1])
            rows.append({"family": family, "scheme": scheme, "normalizer": normalizer, "peak_mib": peak})
        base = next(r["peak_mib"] for r in rows if r["family"] == family and r["scheme"] == "none")
        for row in rows:
            if row["family"] == family:
                row["ratio_vs_none"] = row["peak_mib"] / base if base > 0 else None
    return rows


def format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_table(rows: list[dict]) -> None:
    columns = ["family", "scheme", "normalizer", "backend", "mode", "seq_len", "ms", "ratio_vs_stock", "ratio_vs_none"]
    columns += ["ratio_vs_softmax_eager", "ratio_vs_softmax_sdpa", "peak_mib"]
    cells = [columns]
    for row in rows:
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        values = [row["family"], row["scheme"], row["normalizer"], row["backend"], row["mode"], str(row["seq_len"])]
        ratios = [row.get(key) for key in columns[7:11]]
        cells.append(values + [f"{row['ms']:.2f}"] + [format_ratio(r) for r in ratios] + [peak])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for index, line in enumerate(cells):
        pairs = enumerate(zip(line, widths, strict=True))
        padded = [cell.ljust(width) if i < 5 else cell.rjust(width) for i, (cell, width) in pairs]
        print("  ".join(padded))
        if index == 0:
            print("  ".join("-" * w for w in widths))


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()  # no model-building log lines between the progress lines
    if args.memory_child:
        print(measure_peak_memory(*args.memory_child, args))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flex:  # one compiled flex_attention serves every scheme and shape: past 8 variants dynamo would stop
        torch._dynamo.config.recompile_limit = 1024  # compiling and run it uncompiled, timing the fallback instead
        torch._dynamo.config.accumulated_recompile_limit = 4096
    device = torch.device(args.device)
    load_before = os.getloadavg()[0]
    rows = []
    for family in args.families:
        cases = build_cases(family, args)
        generator = torch.Generator().manual_seed(args.seed)
        check_cases(cases, torch.randint(0, args.vocab, (2, min(args.seq_lens)), generator=generator).to(device))
        for seq_len in args.seq_lens:
            generator = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(0, args.vocab, (args.batch, seq_len), generator=generator).to(device)
            run_cases(cases, ids, args)
            rows.extend(rows_for(cases, seq_len))
            print(f"done: {family} seq_len={seq_len}", flush=True)
    print(
        f"\ntorch {torch.__version__}, transformers {transformers.__version__}, device {device}, "
        f"threads {torch.get_num_threads()}, batch {args.batch}, hidden {args.hidden}, layers {args.layers}, "
        f"heads {args.heads}; median of {args.repeats} after {args.warmup} warmup; ratio_vs_stock divides by the "
        f"stock model on sdpa in the same mode. peak_mib: CUDA only.\n1-min load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs (other work on the machine skews CPU timings).\n"
    )
    print_table(rows)
    memory = memory_rows(args) if args.memory_seq_len else []
    if memory:
        kind = "CUDA peak allocated" if device.type == "cuda" else "CPU peak resident-set growth"
        print(f"\nPeak training memory, {args.memory_seq_len} tokens, batch 1 ({kind}, one process each):")
        for row in memory:
            print(
                f"{row['family']:5} {row['scheme']:14} {row['normalizer']:9} {row['peak_mib']:9.1f} MiB  "
                f"{format_ratio(row['ratio_vs_none'])}x none"
            )
    if args.json:
        with open(args.json, "w") as handle:
            versions = {"torch": torch.__version__, "transformers": transformers.__version__}
            json.dump({"settings": vars(args), **versions, "results": rows, "memory": memory}, handle, indent=2)


if __name__ == "__main__":
    main()
