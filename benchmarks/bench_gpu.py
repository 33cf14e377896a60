"""GPU training-step benchmark: every scheme and normalizer against stock Transformers and x-transformers, one run.

A training step is the forward and backward of the MLM loss (BERT family) or the LM loss (GPT-2 family) under bf16
autocast, no optimizer. Default model: BERT-base width at half depth (hidden 768, 12 heads, 6 layers, FFN 3072,
vocab 8192, dropout 0), shapes 8 x 2048 and 1 x 8192 (batch x tokens). Rows, per family and shape:

* stock ``BertForMaskedLM`` / ``GPT2LMHeadModel`` on sdpa (the ``x stock`` reference) and hf_posenc's ``none``;
* every position encoding with ``softmax``, and every other normalizer with ``learned``, on the backend the library
  picks (``attn_implementation`` left at its default) and on each other backend requested; each row names the
  backends that actually ran (recorded from the model's own backend choice during the timed steps: a request the
  library routes elsewhere shows as ``flex_attention -> sdpa``);
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
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import transformers

import hf_posenc
from hf_posenc import modeling_posenc_common
from hf_posenc.posenc_attention import clear_flex_compile_cache


SCHEMES = list(hf_posenc.list_position_encodings())
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


@dataclass(frozen=True)
class Size:
    hidden: int = 768
    heads: int = 12
    layers: int = 6
    ffn: int = 3072
    vocab: int = 8192


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
    """The stock config fields of the benchmarked shape (dropout off), shared by the stock and the PosEnc model."""
    if family == "bert":
        return dict(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            num_attention_heads=size.heads,
            num_hidden_layers=size.layers,
            intermediate_size=size.ffn,
            max_position_embeddings=max_len,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    return dict(
        vocab_size=size.vocab,
        n_embd=size.hidden,
        n_head=size.heads,
        n_layer=size.layers,
        n_inner=size.ffn,
        n_positions=max_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )


def posenc_model(family: str, size: Size, max_len: int, scheme: str, normalizer: str, attn: str | None):
    fields = dict(architecture(family, size, max_len), position_encoding=scheme, attention_normalizer=normalizer)
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
    return statistics.median(times), peak


class BackendRecorder:
    """Records the backends the PosEnc models choose (``modeling_posenc_common.choose_backend``) while active."""

    def __init__(self):
        self.seen: set[str] = set()
        self.choose = modeling_posenc_common.choose_backend

    def __call__(self, *args, **kwargs) -> str:
        backend = self.choose(*args, **kwargs)
        self.seen.add(backend)
        return backend

    def __enter__(self):
        self.seen.clear()
        modeling_posenc_common.choose_backend = self
        return self

    def __exit__(self, *exc):
        modeling_posenc_common.choose_backend = self.choose


def run_row(row: Row, build: Callable, ids, device, args) -> Row:
    """Time one row from a fresh compile state; a PosEnc row's ``runs_on`` becomes the backends that ran."""
    model = None
    torch._dynamo.reset()
    clear_flex_compile_cache()
    try:
        with BackendRecorder() as recorder:
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


def cases(args) -> list[tuple[str, str]]:
    combos = [(scheme, "softmax") for scheme in args.schemes]
    combos += [("learned", normalizer) for normalizer in args.normalizers if normalizer != "softmax"]
    return combos


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
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=SCHEMES)
    parser.add_argument("--normalizers", nargs="+", choices=NORMALIZERS, default=NORMALIZERS)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=BACKENDS, help="explicit requests timed")
    parser.add_argument("--no-x-transformers", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="also write the markdown table here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    size = TINY if args.tiny else Size()
    shapes = [parse_shape(s) for s in (args.shapes or (["2x16"] if args.tiny else ["8x2048", "1x8192"]))]
    max_len = max(tokens for _, tokens in shapes)
    # One process compiles FlexAttention once per scheme, shape and mode: more than dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    have_x = importlib.util.find_spec("x_transformers") is not None and not args.no_x_transformers
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"{device_name}; torch {torch.__version__}, transformers {transformers.__version__}; bf16 autocast, forward + "
        f"backward of the MLM/LM loss; hidden {size.hidden}, {size.heads} heads, {size.layers} layers, FFN "
        f"{size.ffn}, vocab {size.vocab}; median of {args.repeats} after {args.warmup} warm-up steps."
    )
    print(header)
    if not have_x:
        print("note: x_transformers is not importable (or --no-x-transformers): its rows are skipped.")
    rows: list[Row] = []
    for family in args.families:
        causal = family == "gpt2"
        for batch, tokens in shapes:
            shape = f"{batch}x{tokens}"
            ids = torch.randint(0, size.vocab, (batch, tokens), generator=torch.Generator().manual_seed(0)).to(device)
            stock = partial(with_loss, stock_model, family, size, max_len)
            rows.append(run_row(Row(family, shape, "stock", "sdpa", "sdpa"), stock, ids, device, args))
            for scheme, normalizer in cases(args):
                families = hf_posenc.list_position_encodings()[scheme]["families"]
                normalizer_families = hf_posenc.list_attention_normalizers()[normalizer]["families"]
                if ("decoder" if causal else "encoder") not in set(families) & set(normalizer_families):
                    continue
                name = scheme if normalizer == "softmax" else f"{scheme} + {normalizer}"
                build = partial(with_loss, posenc_model, family, size, max_len, scheme, normalizer)
                default = run_row(Row(family, shape, name, "default", "?"), partial(build, None), ids, device, args)
                rows.append(default)
                for requested in (b for b in args.backends if b != default.runs_on):
                    row = Row(family, shape, name, requested, "?")
                    rows.append(run_row(row, partial(build, requested), ids, device, args))
            if have_x:
                for scheme in [s for s in X_TRANSFORMERS_SCHEMES if s in args.schemes]:
                    row = Row(family, shape, f"x-transformers {scheme}", "flash", "flash")
                    build = partial(x_transformers_step, family, size, max_len, scheme)
                    rows.append(run_row(row, build, ids, device, args))
    stock_ms = {(r.family, r.shape): r.ms for r in rows if r.model == "stock"}
    table = [
        header,
        "",
        "| family | shape | model | backend | ms | x stock | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|",
        *(format_row(row, stock_ms.get((row.family, row.shape))) for row in rows),
    ]
    print("\n".join(table))
    if args.output:
        with open(args.output, "w") as handle:
            handle.write("\n".join(table) + "\n")
    return rows


if __name__ == "__main__":
    main()
