"""The position probe (kexue.fm/archives/9105): the library function and its recipe
(``hf-posenc probe``), reduced."""

from __future__ import annotations

import json
import re

import matplotlib.pyplot as plt
import pytest

import hf_posenc
from hf_posenc_recipes import probe as probe_recipe
from hf_posenc_recipes.parsers.probe import DEFAULT_PROBE_VARIANTS


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_relative_scheme_with_softmax_gives_equal_outputs(family):
    """Rows sum to 1 and every value is the same: every output is the same, to float rounding."""
    result = hf_posenc.probe("t5", "softmax", family=family, length=8, steps=20, learning_rate=3e-3)
    assert result["output_spread"] < 1e-5
    assert result["relative_mse"] > 1.0 - 1e-4  # equal outputs: at best the mean, an error of the variance
    assert result["target_variance"] == pytest.approx((8**2 - 1) / 12)
    assert not result["fitted"]


def test_relative_scheme_with_l2_fits_the_positions():
    result = hf_posenc.probe("t5", "l2", family="gpt2", length=8, steps=100, learning_rate=3e-3)
    assert result["mse"] < 0.01 * result["target_variance"]
    assert result["fitted"]
    assert result["attention_normalizer"]["type"] == "l2" and result["position_encoding"]["type"] == "t5"
    assert [round(p) for p in result["predictions"]] == list(range(1, 9))


def test_probe_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"family 'llama' is not one of \('bert', 'gpt2'\)"):
        hf_posenc.probe("t5", family="llama")
    with pytest.raises(ValueError, match="length must be at least 2"):
        hf_posenc.probe("t5", length=1)


def test_recipe_writes_the_table_the_results_and_the_heat_map(tmp_path):
    argv = ["--families", "gpt2", "--schemes", "learned", "none", "--variants", "softmax", "exp+gate+boundary"]
    argv += ["--seeds", "0", "1", "--length", "4", "--max_train_steps", "2", "--output_dir", str(tmp_path)]
    results = probe_recipe.main(argv)
    assert [(r["scheme"], r["variant"], r["seed"]) for r in results[::2]] == [
        ("learned", "softmax", 0), ("learned", "exp+gate+boundary", 0), ("none", "softmax", 0),
        ("none", "exp+gate+boundary", 0),
    ]  # fmt: skip
    assert results[1]["seed"] == 1 and results[1]["predictions"] != results[0]["predictions"]
    gated = results[2]
    assert gated["attention_normalizer"]["toeplitz_gate"] and gated["boundary_tokens"]
    assert json.loads((tmp_path / "probe_results.json").read_text()) == results
    table = (tmp_path / "probe_table.md").read_text()
    assert "(target variance 1.25)" in table and "exp+gate+boundary" in table
    # none + softmax: every output equal (a spread of float rounding only), neither seed fitted
    none_softmax = [r for r in results if (r["scheme"], r["variant"]) == ("none", "softmax")]
    assert len(none_softmax) == 2 and all(r["output_spread"] < 1e-5 and not r["fitted"] for r in none_softmax)
    assert re.search(r"\| `none` \| [0-9.]+ ✗ 0/2 \((0|[0-9.]+e-0[6-9])\) \|", table)
    assert (tmp_path / "probe_heatmap.png").stat().st_size > 1000


def test_recipe_parses_schemes_with_options_and_rejects_unknown_variants(capsys):
    assert probe_recipe.parse_scheme("shaw:use_value=false,max_distance=4") == {
        "type": "shaw", "use_value": False, "max_distance": 4
    }  # fmt: skip
    with pytest.raises(SystemExit):
        probe_recipe.parse_args(["--variants", "softmax+gated"])
    assert "unknown flag(s) ['gated']" in capsys.readouterr().err
    assert probe_recipe.parse_variant("softmax+sink+boundary") == (
        {"type": "softmax", "toeplitz_gate": False, "sink": "learned"}, True
    )  # fmt: skip
    assert probe_recipe.parse_variant("differential+output_gate") == (
        {"type": "differential", "toeplitz_gate": False, "output_gate": "elementwise"}, False
    )  # fmt: skip
    with pytest.raises(SystemExit):
        probe_recipe.parse_args(["--variants", "l2+sink"])
    assert "'+sink' is an option of softmax only" in capsys.readouterr().err


def test_the_recipe_probes_layouts_at_their_depth(tmp_path):
    """``--layouts``: rows beside the schemes, each model the preset at ``--num_hidden_layers`` with its window; 9105:
    under softmax every layer of ``rope`` or NoPE gives identical tokens identical outputs, windows or not."""
    argv = ["--families", "gpt2", "--schemes", "rope", "--layouts", "rnope_swa", "--sliding_window", "4"]
    argv += ["--num_hidden_layers", "4", "--variants", "softmax", "--length", "8", "--max_train_steps", "3"]
    results = probe_recipe.main([*argv, "--output_dir", str(tmp_path)])
    assert [result["scheme"] for result in results] == ["rope", "rnope_swa"]
    assert [spec["type"] for spec in results[1]["position_encoding"]] == ["rope", "rope", "rope", "none"]
    assert all(result["output_spread"] < 1e-4 for result in results)
    assert "| `rnope_swa` | " in (tmp_path / "probe_table.md").read_text()


def test_stick_breaking_without_a_position_encoding_fits_and_the_grid_leaves_out_encoders(tmp_path):
    """``none`` + stick_breaking: a row sums to 1 - prod_j (1 - sigmoid(b_j)), which grows with the keys before the
    query, so the decoder tells the positions apart; the recipe's grid has no encoder cell for it (decoder only)."""
    result = hf_posenc.probe("none", "stick_breaking", family="gpt2", length=8, steps=100, learning_rate=3e-3)
    assert result["fitted"], result["relative_mse"]
    argv = ["--families", "bert", "gpt2", "--schemes", "none", "--variants", "softmax", "stick_breaking"]
    results = probe_recipe.main([*argv, "--length", "4", "--max_train_steps", "2", "--output_dir", str(tmp_path)])
    assert [(r["family"], r["variant"]) for r in results] == [
        ("bert", "softmax"), ("gpt2", "softmax"), ("gpt2", "stick_breaking")
    ]  # fmt: skip


@pytest.mark.parametrize(("families", "schemes"), [(["gpt2"], ["t5"]), (["bert", "gpt2"], ["learned", "rope", "t5"])])
def test_heat_map_titles_do_not_overlap(families, schemes):
    """The figure's title, each family's title and the colour bar are laid out apart (one row of schemes included)."""
    results = [
        {"family": family, "scheme": scheme, "variant": variant, "relative_mse": 0.01}
        for family in families
        for scheme in schemes
        for variant in DEFAULT_PROBE_VARIANTS
    ]
    figure = probe_recipe.heat_map_figure(results, families, schemes, DEFAULT_PROBE_VARIANTS)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    title = figure._suptitle.get_window_extent(renderer)
    axes = [axis for axis in figure.axes if axis.get_title()]
    assert len(axes) == len(families)
    for axis in axes:
        assert not title.overlaps(axis.title.get_window_extent(renderer)), axis.get_title()
        assert not title.overlaps(axis.get_window_extent(renderer)), axis.get_title()
    plt.close(figure)
