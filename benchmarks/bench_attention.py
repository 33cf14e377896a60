"""Benchmark PosEnc BERT and GPT-2 models against stock Transformers, measured side by side in one run.

For each family (BERT, GPT-2) and sequence length it times, as a ratio to the stock model on sdpa:

* the stock model on sdpa and eager, and ``hf_posenc.convert(stock)`` (learned + softmax, same weights) on sdpa;
* every position encoding with softmax on sdpa and eager (and on flex_attention with ``--flex``);
* the l2 normalizer on eager;
* one training step (forward + backward, no optimizer) of PosEnc learned vs stock, both sdpa.

Every model of a family shares the stock weights and sees the same seeded input ids. Timings are medians over
``--repeats`` calls after ``--warmup`` calls (the first one compiles FlexAttention), run round-robin across the
models so that machine drift hits them all alike. Peak memory is reported on CUDA only (the CPU allocator has no
peak counter), so on CPU the table shows latency only.

    python benchmarks/bench_attention.py                          # CPU defaults: about 2 minutes on 2 idle cores
    python benchmarks/bench_attention.py --flex --json bench.json
    python benchmarks/bench_attention.py --device cuda --batch 32 --seq-lens 512 1024 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import transformers

import hf_posenc


SCHEMES = ["learned", "sinusoidal", "none", "rope", "t5", "alibi"]
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
    return parser.parse_args()


def stock_model(family: str, args: argparse.Namespace) -> transformers.PreTrainedModel:
    """A randomly initialised stock BertModel / GPT2Model on sdpa, dropout off so train and eval do the same work."""
    max_len = max(args.seq_lens)
    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=max_len,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    else:
        config = transformers.GPT2Config(
            vocab_size=args.vocab,
            n_embd=args.hidden,
            n_layer=args.layers,
            n_head=args.heads,
            n_positions=max_len,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
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
    for scheme in SCHEMES:
        converted = hf_posenc.convert(stock, position_encoding=scheme)
        for backend in backends:
            cases.append(Case(family, scheme, "softmax", backend, "forward", on_backend(converted, backend)))
    l2 = on_backend(hf_posenc.convert(stock, attention_normalizer="l2"), "eager")
    cases.append(Case(family, "learned", "l2", "eager", "forward", l2))
    cases.append(Case(family, "stock", "softmax", "sdpa", "train", stock_model(family, args)))
    cases.append(Case(family, "learned", "softmax", "sdpa", "train", hf_posenc.convert(stock_model(family, args))))
    for case in cases:
        case.model.train(case.mode == "train")
    return cases


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
    baseline = {c.mode: statistics.median(c.times) for c in cases if c.scheme == "stock" and c.backend == "sdpa"}
    rows = []
    for case in cases:
        ms = statistics.median(case.times)
        row = {k: v for k, v in asdict(case).items() if k not in ("model", "times")}
        row.update(seq_len=seq_len, ms=ms, ratio_vs_stock=ms / baseline[case.mode], times_ms=case.times)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    columns = ["family", "scheme", "normalizer", "backend", "mode", "seq_len", "ms", "ratio_vs_stock", "peak_mib"]
    cells = [columns]
    for row in rows:
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        values = [row["family"], row["scheme"], row["normalizer"], row["backend"], row["mode"], str(row["seq_len"])]
        cells.append(values + [f"{row['ms']:.2f}", f"{row['ratio_vs_stock']:.3f}", peak])
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
    if args.json:
        with open(args.json, "w") as handle:
            versions = {"torch": torch.__version__, "transformers": transformers.__version__}
            json.dump({"settings": vars(args), **versions, "results": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
