"""The CUDA FlexAttention kernels' numbers without a GPU: the whole grid of ``cuda_proxy.py --interpret``.

``cuda_proxy.py`` (a tool of the project's workspace, not part of the repository: it is read from
``../shared/tools/cuda_proxy.py`` beside the checkout, or from ``--proxy``; it needs ``triton``, which torch 2.13 pins
at 3.7.1) compiles each FlexAttention the library builds for a fake H100, runs inductor's generated Triton
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

A clone of the repository has no ``../shared``: without the tool, ``--list``, ``--summary`` and ``--gpu`` still run.

On a machine with a GPU, ``--gpu`` runs the same tasks on it instead: each model compiled for CUDA as the library
routes it, the real kernels launched, the loss and every gradient, or the logits, compared with the same eager float32
CPU reference and the same tolerances (float32: ``1e-4 * max|ref| + 1e-6``; bf16: ``5e-2 * max|ref| + 1e-3``)::

    python benchmarks/cuda_interpret_grid.py gpu-grid.log --gpu --jobs 12
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
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
WIDTH = 64
BATCH = 2
TOLERANCE = {"float32": (1e-4, 1e-6), "bfloat16": (5e-2, 1e-3)}  # PASS: max |got - ref| <= rtol * max |ref| + atol

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


def tasks(head_dims: tuple[int, ...], dtypes: tuple[str, ...], catalogue_first: bool = False) -> list[tuple]:
    """``(family, scheme, normalizer, request, dtype, head_dim)``: the 2025-26 entries first, then the catalogue's
    (or the catalogue first); in each, by head size, then dtype, then model."""
    parts = [list(variant_models()), list(catalogue_models())]
    return [
        (*model, request, dtype, head_dim)
        for models in (parts[::-1] if catalogue_first else parts)
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
        from hf_posenc_recipes.parsers.common import layout_sizes

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


def tiny_model(family: str, scheme, normalizer, heads: int, attn: str):
    """The tool's tiny models, as its ``make_model`` builds them: one layer of width 64, no dropout, seed 0."""
    import torch
    import transformers

    import hf_posenc

    torch.manual_seed(0)
    if family == "bert":
        config = hf_posenc.PosEncBertConfig(
            position_encoding=scheme, attention_normalizer=normalizer, hidden_size=WIDTH, num_hidden_layers=1,
            num_attention_heads=heads, intermediate_size=64, vocab_size=99, max_position_embeddings=64,
            attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
        )  # fmt: skip
        auto = transformers.AutoModelForMaskedLM
    else:
        config = hf_posenc.PosEncGPT2Config(
            position_encoding=scheme, attention_normalizer=normalizer, n_embd=WIDTH, n_layer=1, n_head=heads,
            vocab_size=99, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )  # fmt: skip
        auto = transformers.AutoModelForCausalLM
    kwargs = {} if attn == "default" else {"attn_implementation": attn}
    return auto.from_config(config, **kwargs)


def start_worker(proxy_path: str) -> None:
    proxy = load_proxy(Path(proxy_path))
    proxy.make_model = with_layouts(tiny_model)
    proxy.init_worker(True)


def run_task(task: tuple) -> list[tuple]:
    family, scheme, normalizer, request, dtype, head_dim = task
    return sys.modules["cuda_proxy"].run_combo_interpret(
        (family, scheme, normalizer, (request,), (dtype,), head_dim, LENGTH)
    )


class OutOfTolerance(Exception):
    """A case whose loss, gradients or logits are outside the tolerance of the eager reference."""


FLEX_CALLS = []  # --gpu: one entry per FlexAttention call of the current case


def start_gpu_worker() -> None:
    """Count the FlexAttention calls the library makes, as the tool does."""
    from hf_posenc import posenc_attention

    attend = posenc_attention.flex_attend

    def counted_flex_attend(*args, **kwargs):
        FLEX_CALLS.append(kwargs.get("region"))
        return attend(*args, **kwargs)

    posenc_attention.flex_attend = counted_flex_attend


def grid_inputs(family: str):
    """The tool's inputs: 2 x 32 tokens, seed 1; for BERT the last 3 tokens are padding (no label, not compared)."""
    import torch

    torch.manual_seed(1)
    ids = torch.randint(3, 99, (BATCH, LENGTH))
    inputs = {"input_ids": ids}
    labels = ids.clone()
    keep = torch.ones(BATCH, LENGTH, dtype=torch.bool)
    if family == "bert":
        inputs["attention_mask"] = (torch.arange(LENGTH) < LENGTH - 3).long().expand(BATCH, LENGTH).contiguous()
        keep = inputs["attention_mask"].bool()
        labels[~keep] = -100
    return inputs, labels, keep


def error_and_allowance(got, want, dtype: str) -> tuple[float, float, float]:
    """``(max |got - want|, rtol * max |want| + atol, max |want|)``; a missing or NaN result has error NaN."""
    rtol, atol = TOLERANCE[dtype]
    want = want.detach().double().cpu()
    scale = want.abs().max().item() if want.numel() else 0.0
    if got is None:
        return float("nan"), rtol * scale + atol, scale
    error = (got.detach().double().cpu() - want).abs().max().item() if want.numel() else 0.0
    return error, rtol * scale + atol, scale


def device_results(model, inputs: dict, labels, keep, train: bool, device: str, dtype: str) -> dict:
    """The loss and every gradient (training) or the logits of the kept tokens, of ``model`` on ``device``, under
    bf16 autocast for ``dtype="bfloat16"``."""
    import contextlib

    import torch

    model = model.to(device).train(train)
    inputs = {key: value.to(device) for key, value in inputs.items()}
    autocast = torch.autocast(device, torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    if not train:
        with torch.no_grad(), autocast:
            return {"logits": model(**inputs).logits[keep.to(device)]}
    with autocast:
        loss = model(**inputs, labels=labels.to(device)).loss
    loss.backward()
    return {"loss": loss} | {name: p.grad for name, p in model.named_parameters()}


def run_case_on_device(task: tuple, train: bool, device: str = "cuda") -> str:
    """One case on ``device``: its result line's message; raises ``OutOfTolerance`` (the message) when a result is
    out of tolerance. A bf16 case out of tolerance also gets the error of the eager path under the same autocast on
    the same device, which tells the kernel's error from bf16's own."""
    import torch

    family, scheme, normalizer, request, dtype, head_dim = task
    make = with_layouts(tiny_model)
    inputs, labels, keep = grid_inputs(family)
    reference = make(family, scheme, normalizer, WIDTH // head_dim, "eager")
    model = make(family, scheme, normalizer, WIDTH // head_dim, request)
    model.load_state_dict(reference.state_dict())
    got = device_results(model, inputs, labels, keep, train, device, dtype)
    want = device_results(reference, inputs, labels, keep, train, "cpu", "float32")
    want = {name: value for name, value in want.items() if value is not None}
    checks = [(name, *error_and_allowance(got.get(name), value, dtype)) for name, value in want.items()]
    bad = [check for check in checks if not check[1] <= check[2]]  # (a NaN error fails)
    extra = [name for name, grad in got.items() if name not in want and grad is not None]
    name, error, _, scale = checks[0]
    message = f"{name} err {error:.1e} (max |ref| {scale:.2g})"
    if len(checks) > 1:
        worst = max(checks[1:], key=lambda check: check[1] / check[2] if check[1] == check[1] else float("inf"))
        message += (
            f", worst grad {worst[0]} err {worst[1]:.1e} (allowed {worst[2]:.1e}, max |ref| {worst[3]:.2g}), "
            f"{len(checks) - 1} grads"
        )
    where = torch.cuda.get_device_name() if device == "cuda" else device
    message += f"; {len(FLEX_CALLS)} flex call(s) on {where}"
    if not (bad or extra):
        return message
    failures = [
        f"{name} err {error:.2e} > {allowed:.1e} (max |ref| {scale:.2g})" for name, error, allowed, scale in bad[:4]
    ]
    failures += [f"grad where eager has none: {name}" for name in extra[:4]]
    if bad and dtype == "bfloat16":
        eager = make(family, scheme, normalizer, WIDTH // head_dim, "eager")
        eager.load_state_dict(reference.state_dict())
        eager_got = device_results(eager, inputs, labels, keep, train, device, dtype)
        errors = [
            f"{name} err {error_and_allowance(eager_got.get(name), want[name], dtype)[0]:.2e}" for name, *_ in bad[:4]
        ]
        failures.append(f"eager under the same autocast on {where}: " + ", ".join(errors))
    raise OutOfTolerance("; ".join(failures) + " | " + message)


def run_task_on_gpu(task: tuple) -> list[tuple]:
    """The task's two cases on the GPU, as ``run_task``'s ``(name, status, stage, message, seconds)``."""
    import torch

    from hf_posenc import attention_backends

    results = []
    for name, train in zip(case_names(task), (True, False), strict=True):
        torch._dynamo.reset()
        attention_backends.clear_flex_compile_cache()  # each case's first call runs its static kernel, as a user's
        FLEX_CALLS.clear()
        start = time.time()
        try:
            results.append((name, "PASS", "", run_case_on_device(task, train), time.time() - start))
        except OutOfTolerance as error:
            results.append((name, "FAIL", "numbers", str(error), time.time() - start))
        except Exception as error:  # noqa: BLE001 -- every failure is recorded, with its type, and the grid goes on
            first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            results.append((name, "FAIL", "run", f"{type(error).__name__}: {first}", time.time() - start))
    return results


def result_line(name: str, status: str, stage: str, message: str, seconds: float) -> str:
    return f"{status} {name}" + (f" @ {stage}" if stage else "") + f": {message} ({seconds:.1f} s)\n"


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
    parser.add_argument(
        "--proxy",
        type=Path,
        default=DEFAULT_PROXY,
        help="path of cuda_proxy.py, a workspace tool that is not in the repository (default: %(default)s)",
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS), choices=[16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--list", action="store_true", help="print the tasks not yet in the results file")
    parser.add_argument("--summary", action="store_true", help="count the results file's cases")
    parser.add_argument("--gpu", action="store_true", help="run the tasks on this machine's GPU, not interpreted")
    parser.add_argument("--catalogue-first", action="store_true", help="run the catalogue's tasks before 2025-26's")
    parser.add_argument(
        "--time-budget", type=float, default=None, help="seconds; the tasks not started by then are left for a rerun"
    )
    args = parser.parse_args()
    if args.summary:
        return 1 if summarize(args.results) else 0
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--gpu: torch sees no CUDA device here (torch.cuda.is_available() is False)")
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    done = {name for _, name in recorded_cases(args.results)}
    grid = tasks(tuple(args.head_dims), tuple(args.dtypes), args.catalogue_first)
    todo = [task for task in grid if not set(case_names(task)) <= done]
    if args.list:
        print("\n".join(map(str, todo)) + f"\n{len(todo)} tasks left")
        return 0
    if not args.gpu and not args.proxy.is_file():
        parser.error(
            f"--proxy {args.proxy}: no such file (cuda_proxy.py is a tool of the project's workspace, kept in "
            "../shared/tools/ beside the checkout, not part of the repository; give its path, or run --gpu on a GPU)"
        )
    start = time.time()
    context = get_context("spawn")
    with (
        args.results.open("a") as out,
        ProcessPoolExecutor(
            args.jobs, context, *((start_gpu_worker, ()) if args.gpu else (start_worker, (str(args.proxy),)))
        ) as pool,
    ):
        pending = {pool.submit(run_task_on_gpu if args.gpu else run_task, task) for task in todo}
        while pending:
            timeout = None if args.time_budget is None else max(0.0, start + args.time_budget - time.time())
            finished, pending = wait(pending, timeout, FIRST_COMPLETED)
            for future in finished:
                for name, status, stage, message, seconds in future.result():
                    out.write(result_line(name, status, stage, message, seconds))
                    out.flush()
                    print(f"{status} {name}", flush=True)
            if args.time_budget is not None and time.time() > start + args.time_budget:  # running tasks finish
                pending = {future for future in pending if not future.cancel()}
    left = sum(not set(case_names(task)) <= {name for _, name in recorded_cases(args.results)} for task in todo)
    print(f"{len(todo) - left} tasks in {time.time() - start:.0f} s" + (f"; {left} left for a rerun" if left else ""))
    return 1 if summarize(args.results) else 0


if __name__ == "__main__":
    sys.exit(main())
