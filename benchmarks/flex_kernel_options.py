"""The sweep that picks FlexAttention's kernel options per pass for a ``score_mod`` whose table takes gradients.

One BERT-base attention layer (8 x 2048 tokens, 12 heads of 64, bf16 q, k, v) with T5's per-distance bias as the
``score_mod`` (``score + table[h, i - j + n - 1]``, a float32 ``(heads, 2n - 1)`` table that requires grad, as
``RelativeScoreBias`` reads it on consecutive positions), forward + backward, timed for each option set of
:data:`OPTION_SETS`: the library's (:data:`hf_posenc.attention_backends.FLEX_CUDA_KERNEL_OPTIONS`, the forward at
inductor's defaults and the backward's small tile), the previous single set (64 x 64 tiles, one stage, applied to both
passes), and forward / backward variants around them. A set that does not compile or load ("out of resource: shared
memory") is a row with its error. Each set is compiled first in its own process (``--compile-jobs``), so the timed
loop reads the kernels from inductor's on-disk cache.

    python benchmarks/flex_kernel_options.py --compile-jobs 8 --output sweep.md      # a GPU, about two minutes
    python benchmarks/flex_kernel_options.py --list                                  # the sets, no torch work
    python benchmarks/flex_kernel_options.py --dry-run                               # CPU: every set's names checked
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import typing
from functools import partial

import torch
from bench_common import print_and_write
from torch.nn.attention.flex_attention import FlexKernelOptions, flex_attention

from hf_posenc.attention_backends import FLEX_CUDA_BACKWARD_OPTIONS, FLEX_CUDA_KERNEL_OPTIONS


SMALL_BACKWARD = dict(FLEX_CUDA_BACKWARD_OPTIONS)


def forward(block_m: int, block_n: int, stages: int, warps: int) -> dict[str, int]:
    """The forward's tile, pipelining depth and warps as ``fwd_*`` kernel options."""
    return {"fwd_BLOCK_M": block_m, "fwd_BLOCK_N": block_n, "fwd_num_stages": stages, "fwd_num_warps": warps}


OPTION_SETS: dict[str, dict[str, typing.Any]] = {
    "library": dict(FLEX_CUDA_KERNEL_OPTIONS),
    "previous (64x64, 1 stage, both passes)": {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1},
    "fwd 128x64 s3 w4": {**forward(128, 64, 3, 4), **SMALL_BACKWARD},
    "fwd 128x128 s3 w8": {**forward(128, 128, 3, 8), **SMALL_BACKWARD},
    "fwd 64x64 s3 w4": {**forward(64, 64, 3, 4), **SMALL_BACKWARD},
    "fwd 128x64 s2 w4": {**forward(128, 64, 2, 4), **SMALL_BACKWARD},
    "bwd 64x64 s2": {**SMALL_BACKWARD, "bwd_num_stages": 2},
    "bwd 32x64/64x32 s1": {
        **SMALL_BACKWARD,
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
    },
}
"""Name -> ``kernel_options``: the forward variants keep the library's backward."""


def check_option_names(options: dict[str, typing.Any]) -> None:
    """Raise ValueError for a name ``FlexKernelOptions`` does not have (after its ``fwd_`` / ``bwd_`` prefix)."""
    known = set(typing.get_type_hints(FlexKernelOptions))
    for name in options:
        bare = name.removeprefix("fwd_").removeprefix("bwd_")
        if bare not in known and name not in known:
            raise ValueError(f"kernel option {name!r} is not a FlexKernelOptions name; valid: {sorted(known)}")


def layer_inputs(batch: int, tokens: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype):
    """q, k, v ``(batch, heads, tokens, head_dim)`` and the float32 per-distance table ``(heads, 2 tokens - 1)``,
    all requiring grad."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch, heads, tokens, head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(device, dtype).requires_grad_() for _ in range(3))
    table = (0.1 * torch.randn(heads, 2 * tokens - 1, generator=generator)).to(device).requires_grad_()
    return q, k, v, table


def per_distance_score_mod(table: torch.Tensor, tokens: int):
    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        return score + table[head_idx, q_idx - kv_idx + tokens - 1]

    return score_mod


def step(attend, q, k, v, table, tokens: int) -> None:
    """One forward + backward; the gradients are dropped."""
    output = attend(q, k, v, score_mod=per_distance_score_mod(table, tokens))
    output.sum().backward()
    for tensor in (q, k, v, table):
        tensor.grad = None


def time_set(name: str, shape: tuple[int, int], repeats: int, device: str) -> tuple[str, float | None, str]:
    """Compile and time one option set: ``(name, median ms of forward + backward, error)``."""
    batch, tokens = shape
    device = torch.device(device)
    options = OPTION_SETS[name]
    try:
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        attend = partial(compiled, kernel_options=options)
        q, k, v, table = layer_inputs(batch, tokens, 12, 64, device, torch.bfloat16)
        step(attend, q, k, v, table, tokens)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(attend, q, k, v, table, tokens)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return name, (statistics.median(times) if times else None), ""
    except Exception as error:  # a set that does not compile or load is a row with its error
        return name, None, f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"


def dry_run() -> list[str]:
    """On CPU: every set's names are FlexKernelOptions names, and the per-distance score_mod (uncompiled flex, tiny
    shapes, no gradients: CPU flex has no backward) equals the eager softmax attention with the table added."""
    lines = []
    for name, options in OPTION_SETS.items():
        check_option_names(options)
        lines.append(f"{name}: {options}")
    tokens = 8
    q, k, v, table = (tensor.detach() for tensor in layer_inputs(1, tokens, 2, 16, torch.device("cpu"), torch.float32))
    with torch.no_grad():  # FlexAttention on CPU has no backward
        output = flex_attention(q, k, v, score_mod=per_distance_score_mod(table, tokens))
    distance = torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :] + tokens - 1
    scores = q @ k.transpose(-1, -2) / 16**0.5 + table[:, distance][None]
    torch.testing.assert_close(output, torch.softmax(scores, dim=-1) @ v, atol=1e-5, rtol=1e-5)
    lines.append("dry run: option names valid; the per-distance score_mod equals eager attention with the table added")
    return lines


def main(argv: list[str] | None = None) -> list[tuple[str, float | None, str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the option sets and stop")
    parser.add_argument("--dry-run", action="store_true", help="on CPU: check the sets' names and the score_mod")
    parser.add_argument("--shape", default="8x2048", help="batch x tokens (default 8x2048)")
    parser.add_argument("--sets", nargs="+", choices=list(OPTION_SETS), default=list(OPTION_SETS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile-jobs", type=int, default=0, help="compile each set first in this many processes")
    parser.add_argument("--compile-only", action="store_true", help="with --compile-jobs: compile, time nothing")
    parser.add_argument("--output", help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.list:
        for name in args.sets:
            print(f"{name}: {OPTION_SETS[name]}")
        return []
    if args.dry_run:
        print("\n".join(dry_run()))
        return []
    if not torch.cuda.is_available():
        sys.exit("flex_kernel_options.py times CUDA kernels: run it on a GPU (--dry-run checks it on CPU)")
    batch, tokens = (int(part) for part in args.shape.split("x"))
    started = time.perf_counter()
    if args.compile_jobs:
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.compile_jobs, maxtasksperchild=1) as pool:
            pool.map(partial(time_set, shape=(batch, tokens), repeats=0, device="cuda"), args.sets)
        print(f"compile: {len(args.sets)} sets in {time.perf_counter() - started:.0f} s", flush=True)
    if args.compile_only:
        return []
    rows = [time_set(name, (batch, tokens), args.repeats, "cuda") for name in args.sets]
    library = next((ms for name, ms, _ in rows if name == "library"), None)
    table = [
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; one layer, {batch} x {tokens}, 12 heads of 64, "
        f"bf16, per-distance float32 table with grad; forward + backward, median of {args.repeats}",
        "",
        "| option set | ms | x library | options | error |",
        "|---|---|---|---|---|",
    ]
    for name, ms, error in rows:
        ratio = f"{ms / library:.2f}" if ms is not None and library else "-"
        table.append(f"| {name} | {'-' if ms is None else f'{ms:.2f}'} | {ratio} | {OPTION_SETS[name]} | {error} |")
    print_and_write(table, args.output)
    return rows


if __name__ == "__main__":
    main()
