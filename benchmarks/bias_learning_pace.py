"""How fast position-only biases learn: small byte-level decoders trained side by side, loss at 1x to 8x length.

Each scheme trains a ``posenc_gpt2`` decoder (bytes as tokens, width 128, 3 layers, 4 heads, no dropout) with AdamW
at 1e-3 on batches of 32 x 64 bytes of ``--corpus``, from the same seed and the same batches. After training it
reports the next-byte loss (nats/byte) on held-out text at 1x, 2x, 4x and 8x the training length, scored as the
extrapolation recipe does (``hf_posenc_recipes.extrapolate.sliding_window_loss``: windows of L bytes moved by
the training length, each scored on its last training-length positions), and the ratio of the last to the first (how
well the scheme extrapolates). It measures how fast a bias table learns (``t5`` with and without ``table_scale``)
and how each scheme holds past its training length.

    python benchmarks/bias_learning_pace.py                                   # t5, alibi, kerple, fire; 600 steps
    python benchmarks/bias_learning_pace.py --steps 300 --schemes t5 '{"type": "t5", "table_scale": 1.0}'
    python benchmarks/bias_learning_pace.py --schemes t5 '{"type": "t5", "init": "decay"}' x-transformers

``--corpus`` is any plain-text file. Its default, ``../shared/data/corpus/austen.txt`` beside the checkout (six Jane
Austen novels, 4.0 MB, public domain, from Debian's r-cran-janeaustenr), is a file of the project's workspace that the
repository does not ship: a clone gives ``--corpus`` a file of its own.

A scheme is a name or a JSON ``position_encoding`` dict; ``x-transformers`` is the anchor: x-transformers'
``Decoder(dim=128, depth=3, heads=4, attn_dim_head=32, rel_pos_bias=True)`` (its T5 bias, table ``N(0, 1)`` read
times ``sqrt(32)``), trained on the same batches (``pip install x-transformers``). CPU, 2 threads: about 1 minute per
scheme at 600 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers
from bench_common import Size, architecture
from torch import nn
from tqdm import tqdm

import hf_posenc
from hf_posenc_recipes.extrapolate import sliding_window_loss


DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus" / "austen.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=["t5", "alibi", "kerple", "fire"])
    parser.add_argument(
        "--corpus", type=Path, default=DEFAULT_CORPUS, help="plain text, read as bytes (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="training length (bytes)")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8], help="evaluate at these multiples")
    parser.add_argument("--eval-bytes", type=int, default=65536, help="held-out bytes evaluated at each length")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", metavar="PATH", help="save settings and results as JSON")
    args = parser.parse_args()
    if not args.corpus.is_file():
        parser.error(
            f"--corpus {args.corpus}: no such file (the default is a file of the project's workspace, "
            "../shared/data/corpus/austen.txt beside the checkout, not part of the repository; give a plain-text file)"
        )
    return args


def parse_scheme(text: str):
    return json.loads(text) if text.lstrip().startswith("{") else text


def byte_model(position_encoding, max_length: int, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    fields = architecture("gpt2", Size(hidden=128, heads=4, layers=3, ffn=4 * 128, vocab=256), max_length)
    config = hf_posenc.PosEncGPT2Config(position_encoding=position_encoding, **fields, bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


class XTransformersDecoder(nn.Module):
    """x-transformers' byte decoder with its T5 relative bias, called as a Transformers causal LM is here:
    ``model(ids, labels=ids).loss`` and ``model(input_ids=ids).logits``."""

    def __init__(self, max_length: int, seed: int):
        from x_transformers import Decoder, TransformerWrapper

        super().__init__()
        torch.manual_seed(seed)
        layers = Decoder(dim=128, depth=3, heads=4, attn_dim_head=32, rel_pos_bias=True)
        self.net = TransformerWrapper(num_tokens=256, max_seq_len=max_length, attn_layers=layers)
        self.config = transformers.PretrainedConfig(position_encoding="x-transformers rel_pos_bias")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.net(input_ids)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = torch.frombuffer(bytearray(args.corpus.read_bytes()), dtype=torch.uint8).long()
    split = int(len(data) * 0.95)
    train, held_out = data[:split], data[split : split + args.eval_bytes]
    lengths = [factor * args.length for factor in args.factors]
    generator = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(train) - args.length, (args.steps, args.batch), generator=generator)
    offsets = torch.arange(args.length)
    results = []
    for text in args.schemes:
        scheme = parse_scheme(text)
        if scheme == "x-transformers":
            model = XTransformersDecoder(max(lengths), args.seed).train()
        else:
            model = byte_model(scheme, max(lengths), args.seed).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        began = time.perf_counter()
        for step in tqdm(range(args.steps), desc=str(text), leave=False):
            batch = train[starts[step][:, None] + offsets]
            loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        seconds = time.perf_counter() - began
        model.eval()
        losses = {length: sliding_window_loss(model, held_out, length, args.length, args.batch) for length in lengths}
        first, last = losses[lengths[0]], losses[lengths[-1]]
        row = {
            "scheme": model.config.position_encoding,
            "train_loss_last": loss.item(),
            **{f"loss_at_{length}": value for length, value in losses.items()},
            "ratio": last / first,
            "train_seconds": seconds,
        }
        results.append(row)
        columns = "  ".join(f"loss@{length} {value:.3f}" for length, value in losses.items())
        print(f"{json.dumps(row['scheme']):70s} {columns}  ratio {last / first:.3f}  ({seconds:.0f} s)", flush=True)
        if not math.isfinite(first):
            raise RuntimeError(f"{text}: loss is not finite")
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        Path(args.json).write_text(json.dumps({"settings": settings, "results": results}, indent=2))


if __name__ == "__main__":
    main()
