"""``hf-posenc probe``: the position probe (kexue.fm/archives/9105), n identical tokens in, positions 1..n out, for a
grid of model family x position encoding x normalizer variant. Prints and saves the table of final mean squared
errors (against the targets' variance, the error of predicting their mean) and a heat map.

    hf-posenc probe                                   # the README table: every scheme, the default variants
    hf-posenc probe --families gpt2 --schemes t5 alibi --variants softmax l2 softmax+gate softmax+boundary
    hf-posenc probe --schemes rope none --layouts irope smollm3 rnope_swa --sliding_window 8 --attention_chunk_size 8 \
        --num_hidden_layers 4

A variant is a normalizer name, optionally with ``+gate`` (the Toeplitz gate) and ``+boundary`` (boundary tokens:
[CLS] ... [SEP] in the encoder, a BOS in the decoder). A scheme is a name, optionally with options:
``shaw:use_value=false``. Every run is seeded; with several ``--seeds`` a cell gives the median MSE and how many
seeds fitted. Several processes (``torchrun``, ``accelerate launch``) split the grid. On a 2-core CPU six schemes with
the default variants (one seed) took about a minute and a half.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

import hf_posenc
from hf_posenc_recipes.cli import run_recipe
from hf_posenc_recipes.common import progress_bar_off, recipe_accelerator, torch_threads
from hf_posenc_recipes.parsers.common import check_layout_sizes, layout_sizes, parse_scheme, parse_variant
from hf_posenc_recipes.parsers.probe import probe_parser


def default_schemes() -> list[str]:
    schemes = list(hf_posenc.list_position_encodings())
    if "shaw" in schemes:  # Shaw's value term is the article's other cure: with and without it
        schemes.insert(schemes.index("shaw") + 1, "shaw:use_value=false")
    return schemes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = probe_parser()
    args = parser.parse_args(argv)
    check_layout_sizes(parser, args)
    schemes = args.schemes or ([] if args.layouts else default_schemes())
    args.schemes = schemes + args.layouts  # the rows of the table: schemes, then layouts
    return args


def model_layout(args: argparse.Namespace, entry: str) -> dict:
    """The probe's position-encoding arguments for one row: a scheme on every layer, or a layout's preset."""
    if entry not in args.layouts:
        return {"position_encoding": parse_scheme(entry), "num_hidden_layers": args.num_hidden_layers}
    sizes = layout_sizes(entry, args.sliding_window, args.attention_chunk_size)
    return {
        **hf_posenc.layout_preset(entry, args.num_hidden_layers, *sizes),
        "num_hidden_layers": args.num_hidden_layers,
    }


def run_grid(args: argparse.Namespace, process_index: int = 0, num_processes: int = 1) -> list[dict]:
    """The probes of the grid that fall to this process (every ``num_processes``-th, from ``process_index``)."""
    encodings, normalizers = hf_posenc.list_position_encodings(), hf_posenc.list_attention_normalizers()

    def has_form(family: str, scheme: str, variant: str) -> bool:  # both have a form for the family
        kind = "encoder" if family == "bert" else "decoder"
        if kind == "encoder" and scheme in args.layouts and hf_posenc.LAYOUT_PRESETS[scheme].chunks:
            return False  # chunked attention is causal
        normalizer = parse_variant(variant)[0]["type"]
        specs = model_layout(args, scheme)["position_encoding"]
        types = {spec["type"] for spec in (specs if isinstance(specs, list) else [specs])}
        return (
            all(kind in encodings[name]["families"] for name in types) and kind in normalizers[normalizer]["families"]
        )

    grid = [
        (family, scheme, variant, seed)
        for family in args.families
        for scheme in args.schemes
        for variant in args.variants
        for seed in args.seeds
        if has_form(family, scheme, variant)
    ]
    results = []
    mine = list(enumerate(grid))[process_index::num_processes]
    bar = progress_bar_off(process_index == 0)
    for index, (family, scheme, variant, seed) in tqdm(mine, desc="probe", disable=bar):
        normalizer, boundary = parse_variant(variant)
        start = time.perf_counter()
        result = hf_posenc.probe(
            **model_layout(args, scheme),
            attention_normalizer=normalizer,
            family=family,
            boundary_tokens=boundary,
            length=args.length,
            steps=args.max_train_steps,
            seed=seed,
            learning_rate=args.learning_rate,
        )
        seconds = time.perf_counter() - start
        entry = {"scheme": scheme, "variant": variant, "seconds": seconds, "process": process_index, **result}
        results.append((index, entry))
    return results


def markdown_table(results: list[dict], families: list[str], schemes: list[str], variants: list[str]) -> str:
    """One table per family: rows schemes, columns variants; each cell the final MSE (median over seeds) and whether
    it fitted (how many seeds did)."""
    by_key = group_seeds(results)
    lines = []
    for family in families:
        rows = [s for s in schemes if any((family, s, v) in by_key for v in variants)]
        if not rows:
            continue
        variance = next(r["target_variance"] for r in results if r["family"] == family)
        kind = "encoder" if family == "bert" else "decoder"
        lines += [
            f"**{family}** ({kind}): final MSE on the positions 1..n (target variance {variance:.2f}); "
            "✓ fitted (MSE < 5% of the variance; with several seeds: the median, and how many fitted), ✗ not, "
            "with the spread max - min of the n outputs",
            "",
            "| scheme | " + " | ".join(variants) + " |",
            "|---|" + "---|" * len(variants),
        ]
        for scheme in rows:
            cells = [_cell(by_key.get((family, scheme, variant))) for variant in variants]
            lines.append(f"| `{scheme}` | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def group_seeds(results: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """``(family, scheme, variant) -> [result per seed]``."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for result in results:
        groups.setdefault((result["family"], result["scheme"], result["variant"]), []).append(result)
    return groups


def _median(results: list[dict], key: str) -> float:
    return statistics.median(result[key] for result in results)


def _cell(results: list[dict] | None) -> str:
    if not results:
        return ""
    fitted = sum(result["fitted"] for result in results)
    count = f" {fitted}/{len(results)}" if len(results) > 1 else ""
    mse = _median(results, "mse")
    if 2 * fitted > len(results):
        return f"{mse:.3g} ✓{count}"
    return f"{mse:.3g} ✗{count} ({_median(results, 'output_spread'):.1g})"


def heat_map(results: list[dict], families: list[str], schemes: list[str], variants: list[str], path: Path) -> None:
    """:func:`heat_map_figure` saved as ``path``."""
    import matplotlib.pyplot as plt

    figure = heat_map_figure(results, families, schemes, variants)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def heat_map_figure(results: list[dict], families: list[str], schemes: list[str], variants: list[str]):
    """log10(MSE / variance) per family, schemes x variants (the median over seeds): a matplotlib ``Figure``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_key = group_seeds(results)
    size = (1.3 * len(variants) * len(families) + 2, 0.5 * len(schemes) + 2.5)
    figure, axes = plt.subplots(1, len(families), figsize=size, layout="constrained")  # the titles and bar laid out
    axes = [axes] if len(families) == 1 else list(axes)
    for axis, family in zip(axes, families, strict=True):
        grid = torch.full((len(schemes), len(variants)), float("nan"))
        for i, scheme in enumerate(schemes):
            for j, variant in enumerate(variants):
                group = by_key.get((family, scheme, variant))
                if group:
                    grid[i, j] = math.log10(max(_median(group, "relative_mse"), 1e-6))
        image = axis.imshow(grid.numpy(), cmap="viridis", vmin=-5, vmax=0, aspect="auto")
        for i in range(len(schemes)):
            for j in range(len(variants)):
                if not math.isnan(grid[i, j]):
                    value = round(float(grid[i, j]), 1) + 0.0  # no "-0.0"
                    axis.text(j, i, f"{value:.1f}", ha="center", va="center", color="w" if value < -2 else "k")
        axis.set_xticks(range(len(variants)), variants, rotation=45, ha="right")
        axis.set_yticks(range(len(schemes)), schemes)
        axis.set_title(f"{family} ({'encoder' if family == 'bert' else 'decoder'})")
    figure.colorbar(image, ax=axes, label="log10(final MSE / target variance)")
    figure.suptitle("Position probe: n identical tokens -> positions 1..n (0 = predicts the mean)")
    return figure


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with torch_threads(args.threads):
        return probe_all(args)


def probe_all(args: argparse.Namespace) -> list[dict]:
    """Probe every cell of the grid ``args`` give."""
    accelerator = recipe_accelerator(args)
    mine = run_grid(args, accelerator.process_index, accelerator.num_processes)
    results = [entry for _, entry in sorted(gather_object(mine), key=lambda pair: pair[0])]
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        table = markdown_table(results, args.families, args.schemes, args.variants)
        print(table)
        (args.output_dir / "probe_table.md").write_text(table)
        (args.output_dir / "probe_results.json").write_text(json.dumps(results, indent=1))
        heat_map(results, args.families, args.schemes, args.variants, args.output_dir / "probe_heatmap.png")
    accelerator.wait_for_everyone()
    return results


if __name__ == "__main__":  # python recipes/probe.py ..., accelerate launch recipes/probe.py ...
    raise SystemExit(run_recipe("probe", sys.argv[1:], main))
