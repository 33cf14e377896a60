"""The CUDA FlexAttention kernels' numbers without a GPU: the whole grid of ``cuda_proxy.py --interpret``.

``cuda_proxy.py`` (a project tool kept beside the checkout, ``../shared/tools/``; it needs ``triton``, which torch
2.13 pins at 3.7.1) compiles each FlexAttention the library builds for a fake H100, runs inductor's generated Triton
kernels, forward and backward, in Triton's interpreter on the CPU, and compares the training step's loss and every
gradient, or the inference logits, with an eager CPU run of the same weights. Its own command pairs each normalizer
with ``t5`` only and takes names; this script runs every case of the grid through its ``run_combo_interpret``:

* every scheme with softmax in each family it has (and Shaw without its value term);
* every normalizer with ``t5`` and with ``rope``; the sink, learned and fixed at 0.0;
* the attention variants of 2025 (``differential``; ``output_gate`` elementwise and headwise) and the 2025-26 layouts
  (``irope``, ``rnope_swa``, ``smollm3``: two layers, windows and chunks of 8 tokens over 32);
* the default ``attn_implementation`` and FlexAttention requested, float32 and bf16 autocast, heads of 32 and 16.

Each task (one model, one request, one dtype, one head size: a training step and an inference forward) appends its
two result lines to ``RESULTS``; a rerun skips the tasks already there, so the grid can be run in pieces::

    python benchmarks/cuda_interpret_grid.py grid.log --jobs 2            # everything not yet in grid.log
    python benchmarks/cuda_interpret_grid.py grid.log --list              # what is left
    python benchmarks/cuda_interpret_grid.py grid.log --summary           # passed / failed per dtype and head size
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any


DEFAULT_PROXY = Path(__file__).resolve().parents[2] / "shared" / "tools" / "cuda_proxy.py"
FAMILIES = ("gpt2", "bert")
REQUESTS = ("default", "flex_attention")
DTYPES = ("float32", "bfloat16")
HEAD_DIMS = (32, 16)
LENGTH = 32
LAYOUTS = ("irope", "rnope_swa", "smollm3")
LAYOUT_WINDOW = 8

CASE_LINE = re.compile(r"^(PASS|FAIL) (.*? attn=\S+ (?:float32|bfloat16))", re.MULTILINE)
Model = tuple[str, Any, Any]  # (family, scheme spec, normalizer spec)


def has_family(family: str, entry: dict) -> bool:
    return ("encoder" if family == "bert" else "decoder") in entry["families"]


def variant_models() -> Iterator[Model]:
    """The 2025-26 entries: differential attention, the output gate, the sinks, the layouts, PaTH and PaTH-FoX."""
    import hf_posenc

    differential = hf_posenc.list_attention_normalizers()["differential"]
    for family in FAMILIES:
        for scheme in ("t5", "rope"):
            if has_family(family, differential):
                yield family, scheme, "differential"
            for gate in ("elementwise", "headwise"):
                yield family, scheme, {"type": "softmax", "output_gate": gate}
            for sink in ("learned", 0.0):
                yield family, scheme, {"type": "softmax", "sink": sink}
    yield from (("gpt2", {"layout": name}, "softmax") for name in LAYOUTS)
    yield from (("gpt2", scheme, "softmax") for scheme in ("path", {"type": "path", "forget_gate": True}))


def catalogue_models() -> Iterator[Model]:
    """Every other normalizer with ``rope`` and ``t5``, every other scheme with softmax, Shaw without its value
    term."""
    import hf_posenc

    schemes = hf_posenc.list_position_encodings()
    normalizers = hf_posenc.list_attention_normalizers()
    for family in FAMILIES:
        for scheme in ("rope", "t5"):
            for name, entry in normalizers.items():
                if name not in ("softmax", "differential") and has_family(family, entry):
                    yield family, scheme, name
    for family in FAMILIES:
        for name, entry in schemes.items():
            if name != "path" and has_family(family, entry):
                yield family, name, "softmax"
        yield family, {"type": "shaw", "use_value": False}, "softmax"


def grid_models() -> list[Model]:
    """Every model of the grid, the 2025-26 entries first."""
    return [*variant_models(), *catalogue_models()]


def tasks(head_dims: tuple[int, ...], dtypes: tuple[str, ...]) -> list[tuple]:
    """``(family, scheme, normalizer, request, dtype, head_dim)``: the 2025-26 entries first, then the catalogue's;
    in each, by head size, then dtype, then model."""
    return [
        (*model, request, dtype, head_dim)
        for models in (list(variant_models()), list(catalogue_models()))
        for head_dim in head_dims
        for dtype in dtypes
        for model in models
        for request in REQUESTS
    ]


def case_names(task: tuple) -> list[str]:
    """The names ``run_combo_interpret`` gives the task's two cases."""
    family, scheme, normalizer, request, dtype, head_dim = task
    return [
        f"{family} {scheme}+{normalizer} hd{head_dim} L{LENGTH} {mode} attn={request} {dtype}"
        for mode in ("train", "infer")
    ]


def load_proxy(path: Path):
    spec = importlib.util.spec_from_file_location("cuda_proxy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_proxy"] = module
    spec.loader.exec_module(module)
    return module


def with_layouts(make_model):
    """The tool's ``make_model``, plus a scheme ``{"layout": name}``: a two-layer GPT-2 of that layout preset."""

    def make(family, scheme, normalizer, heads, attn):
        if not (isinstance(scheme, dict) and "layout" in scheme):
            return make_model(family, scheme, normalizer, heads, attn)
        import torch
        import transformers

        import hf_posenc
        from hf_posenc_cli.arguments import layout_sizes

        torch.manual_seed(0)  # as the tool's make_model
        sizes = layout_sizes(scheme["layout"], LAYOUT_WINDOW, LAYOUT_WINDOW)
        layout = hf_posenc.layout_preset(scheme["layout"], 2, *sizes)
        config = hf_posenc.PosEncGPT2Config(
            attention_normalizer=normalizer, n_embd=64, n_layer=2, n_head=heads, vocab_size=99, n_positions=64,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **layout,
        )  # fmt: skip
        kwargs = {} if attn == "default" else {"attn_implementation": attn}
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs)

    return make


def start_worker(proxy_path: str) -> None:
    proxy = load_proxy(Path(proxy_path))
    proxy.make_model = with_layouts(proxy.make_model)
    proxy.init_worker(True)


def run_task(task: tuple) -> list[tuple]:
    family, scheme, normalizer, request, dtype, head_dim = task
    return sys.modules["cuda_proxy"].run_combo_interpret(
        (family, scheme, normalizer, (request,), (dtype,), head_dim, LENGTH)
    )


def recorded_cases(results: Path) -> list[tuple[str, str]]:
    """``(status, case name)`` of every result line in the file."""
    if not results.is_file():
        return []
    return CASE_LINE.findall(results.read_text())


def summarize(results: Path) -> int:
    """Print the passed and failed cases per dtype and head size, and each failure; return how many failed."""
    counts = Counter()
    for status, name in recorded_cases(results):
        words = name.split()
        counts[words[-1], words[-5], status] += 1  # dtype, hd<N>
    for (dtype, head, status), count in sorted(counts.items()):
        print(f"{dtype} {head}: {count} {status}")
    failed = [name for status, name in recorded_cases(results) if status == "FAIL"]
    print(f"{sum(counts.values())} cases, {len(failed)} failed" + "".join(f"\n  FAIL {name}" for name in failed))
    return len(failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="the results file: appended to, read to skip finished tasks")
    parser.add_argument("--proxy", type=Path, default=DEFAULT_PROXY, help="path of cuda_proxy.py")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS), choices=[16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--list", action="store_true", help="print the tasks not yet in the results file")
    parser.add_argument("--summary", action="store_true", help="count the results file's cases")
    args = parser.parse_args()
    if args.summary:
        return 1 if summarize(args.results) else 0
    if not args.proxy.is_file():
        parser.error(f"--proxy {args.proxy}: no such file (the project's cuda_proxy.py, kept beside the checkout)")
    done = {name for _, name in recorded_cases(args.results)}
    todo = [task for task in tasks(tuple(args.head_dims), tuple(args.dtypes)) if not set(case_names(task)) <= done]
    if args.list:
        print("\n".join(map(str, todo)) + f"\n{len(todo)} tasks left")
        return 0
    start = time.time()
    context = get_context("spawn")
    with (
        args.results.open("a") as out,
        ProcessPoolExecutor(args.jobs, context, start_worker, (str(args.proxy),)) as pool,
    ):
        futures = {pool.submit(run_task, task): task for task in todo}
        for future in as_completed(futures):
            for name, status, stage, message, seconds in future.result():
                out.write(f"{status} {name}" + (f" @ {stage}" if stage else "") + f": {message} ({seconds:.1f} s)\n")
                out.flush()
                print(f"{status} {name}", flush=True)
    print(f"{len(todo)} tasks in {time.time() - start:.0f} s")
    return 1 if summarize(args.results) else 0


if __name__ == "__main__":
    sys.exit(main())
