"""The position probe (kexue.fm/archives/9105): n identical tokens in, positions 1..n out, for a grid of model family
x position encoding x normalizer variant. Prints and saves the table of final mean squared errors (against the
targets' variance, the error of predicting their mean) and a heat map.

    python recipes/probe.py                                   # the README table: every scheme, the default variants
    python recipes/probe.py --families gpt2 --schemes t5 alibi --variants softmax l2 softmax+gate softmax+boundary

A variant is a normalizer name, optionally with ``+gate`` (the Toeplitz gate) and ``+boundary`` (boundary tokens:
[CLS] ... [SEP] in the encoder, a BOS in the decoder). A scheme is a name, optionally with options:
``shaw:use_value=false``. Every run is seeded (``--seed``); on a 2-core CPU the default grid takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_posenc


DEFAULT_VARIANTS = ["softmax", "l2", "exp", "relu2", "swish_l2", "softmax+gate", "softmax+boundary"]


def default_schemes() -> list[str]:
    schemes = list(hf_posenc.list_position_encodings())
    if "shaw" in schemes:  # Shaw's value term is the article's other cure: with and without it
        schemes.insert(schemes.index("shaw") + 1, "shaw:use_value=false")
    return schemes


def parse_scheme(text: str) -> dict:
    """``name`` or ``name:key=value,key=value`` (values: true/false, numbers, or strings) -> a config dict."""
    name, _, options = text.partition(":")
    spec: dict = {"type": name}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        spec[key] = {"true": True, "false": False}.get(value.lower(), _number_or_string(value))
    return spec


def _number_or_string(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_variant(text: str) -> tuple[dict, bool]:
    """``normalizer[+gate][+boundary]`` -> (the normalizer's config dict, boundary tokens)."""
    name, *flags = text.split("+")
    unknown = set(flags) - {"gate", "boundary"}
    if unknown:
        raise ValueError(f"variant {text!r}: unknown flag(s) {sorted(unknown)}; valid: '+gate', '+boundary'.")
    return {"type": name, "toeplitz_gate": "gate" in flags}, "boundary" in flags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--schemes", nargs="+", default=default_schemes())
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--length", type=int, default=16, help="n, the number of identical tokens")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is fastest)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/probe"))
    args = parser.parse_args(argv)
    encodings, normalizers = hf_posenc.list_position_encodings(), hf_posenc.list_attention_normalizers()
    for scheme in args.schemes:
        if parse_scheme(scheme)["type"] not in encodings:
            parser.error(f"unknown scheme {scheme!r}; valid: {sorted(encodings)}")
    for variant in args.variants:
        try:
            normalizer, _ = parse_variant(variant)
        except ValueError as error:
            parser.error(str(error))
        if normalizer["type"] not in normalizers:
            parser.error(f"unknown normalizer in {variant!r}; valid: {sorted(normalizers)}")
    return args


def run_grid(args: argparse.Namespace) -> list[dict]:
    families = hf_posenc.list_position_encodings()
    grid = [
        (family, scheme, variant)
        for family in args.families
        for scheme in args.schemes
        for variant in args.variants
        if ("encoder" if family == "bert" else "decoder") in families[parse_scheme(scheme)["type"]]["families"]
    ]
    results = []
    for family, scheme, variant in tqdm(grid, desc="probe"):
        normalizer, boundary = parse_variant(variant)
        start = time.perf_counter()
        result = hf_posenc.probe(
            parse_scheme(scheme),
            normalizer,
            family=family,
            boundary_tokens=boundary,
            length=args.length,
            steps=args.steps,
            seed=args.seed,
            learning_rate=args.lr,
        )
        results.append({"scheme": scheme, "variant": variant, "seconds": time.perf_counter() - start, **result})
    return results


def markdown_table(results: list[dict], families: list[str], schemes: list[str], variants: list[str]) -> str:
    """One table per family: rows schemes, columns variants; each cell the final MSE, fit or not."""
    by_key = {(r["family"], r["scheme"], r["variant"]): r for r in results}
    lines = []
    for family in families:
        rows = [s for s in schemes if any((family, s, v) in by_key for v in variants)]
        if not rows:
            continue
        variance = next(r["target_variance"] for r in results if r["family"] == family)
        kind = "encoder" if family == "bert" else "decoder"
        lines += [
            f"**{family}** ({kind}): final MSE on the positions 1..n (target variance {variance:.2f}); "
            "✓ fitted (MSE < 5% of the variance), ✗ not, with the spread max - min of the n outputs",
            "",
            "| scheme | " + " | ".join(variants) + " |",
            "|---|" + "---|" * len(variants),
        ]
        for scheme in rows:
            cells = [_cell(by_key.get((family, scheme, variant))) for variant in variants]
            lines.append(f"| `{scheme}` | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(result: dict | None) -> str:
    if result is None:
        return ""
    if result["fitted"]:
        return f"{result['mse']:.3g} ✓"
    return f"{result['mse']:.3g} ✗ ({result['output_spread']:.1g})"


def heat_map(results: list[dict], families: list[str], schemes: list[str], variants: list[str], path: Path) -> None:
    """log10(MSE / variance) per family, schemes x variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = {(r["family"], r["scheme"], r["variant"]): r for r in results}
    figure, axes = plt.subplots(
        1, len(families), figsize=(1.3 * len(variants) * len(families) + 2, 0.5 * len(schemes) + 2)
    )
    axes = [axes] if len(families) == 1 else list(axes)
    for axis, family in zip(axes, families, strict=True):
        grid = torch.full((len(schemes), len(variants)), float("nan"))
        for i, scheme in enumerate(schemes):
            for j, variant in enumerate(variants):
                result = by_key.get((family, scheme, variant))
                if result is not None:
                    grid[i, j] = math.log10(max(result["relative_mse"], 1e-6))
        image = axis.imshow(grid.numpy(), cmap="viridis", vmin=-5, vmax=0, aspect="auto")
        for i in range(len(schemes)):
            for j in range(len(variants)):
                if not math.isnan(grid[i, j]):
                    axis.text(
                        j, i, f"{grid[i, j]:.1f}", ha="center", va="center", color="w" if grid[i, j] < -2 else "k"
                    )
        axis.set_xticks(range(len(variants)), variants, rotation=45, ha="right")
        axis.set_yticks(range(len(schemes)), schemes)
        axis.set_title(f"{family} ({'encoder' if family == 'bert' else 'decoder'})")
    figure.colorbar(image, ax=axes, label="log10(final MSE / target variance)")
    figure.suptitle("Position probe: n identical tokens -> positions 1..n (0 = predicts the mean)")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run_grid(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, args.families, args.schemes, args.variants)
    print(table)
    (args.output_dir / "probe_table.md").write_text(table)
    (args.output_dir / "probe_results.json").write_text(json.dumps(results, indent=1))
    heat_map(results, args.families, args.schemes, args.variants, args.output_dir / "probe_heatmap.png")
    return results


if __name__ == "__main__":
    main()
