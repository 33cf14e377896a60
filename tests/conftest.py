"""Tiny model factories shared by the tests. Every model is small enough to run on a CPU in milliseconds."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import types
from pathlib import Path

import pytest
import torch
import transformers
from torch.nn.attention.flex_attention import flex_attention

import hf_posenc
from hf_posenc import attention_backends, score_bias_encodings
from hf_posenc.position_encodings import POSITION_ENCODINGS
from hf_posenc.position_interface import CACHE_NAME


ROOT = Path(__file__).resolve().parents[1]
CLI_ENV = {
    **{name: value for name, value in os.environ.items() if name != "ACCELERATE_USE_CPU"},
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),  # this checkout first
    "HF_HUB_OFFLINE": "1",  # no command here needs the Hub; a name that is not a folder must not wait for it
}

# The start of a ``python -c`` script that loads a saved folder as a user without hf_posenc does: every import of
# hf_posenc raises ImportError (checked), torch and transformers are imported.
WITHOUT_HF_POSENC = textwrap.dedent(
    """
    import sys
    sys.modules["hf_posenc"] = None  # any import of hf_posenc now raises ImportError
    import torch, transformers
    try:
        import hf_posenc  # noqa: F401
        raise SystemExit("hf_posenc should not be importable here")
    except ImportError:
        pass
    """
)

SCHEMES = list(hf_posenc.list_position_encodings())
NORMALIZER_CATALOGUE = hf_posenc.list_attention_normalizers()
NORMALIZERS = list(NORMALIZER_CATALOGUE)
FAMILIES = ["bert", "gpt2"]
CATALOGUE = hf_posenc.list_position_encodings()
RELATIVE_SCHEMES = [name for name, entry in CATALOGUE.items() if entry["relative"]]
DECODER_SCHEMES = [name for name, entry in CATALOGUE.items() if "decoder" in entry["families"]]
ENCODER_SCHEMES = [name for name, entry in CATALOGUE.items() if "encoder" in entry["families"]]
# Every scheme with softmax, and every other normalizer with a representative absolute and relative scheme: the
# behaviours of a normalizer do not depend on which scheme feeds it scores, so the full cross product adds only time.
REPRESENTATIVE_SCHEMES = ["learned", "t5"]
# Options that make a normalizer another formula, run through the same properties as the registry's names.
NORMALIZER_VARIANTS = [
    {"type": "softmax", "sink": "learned"},
    {"type": "softmax", "output_gate": "elementwise"},
    {"type": "differential", "output_gate": "headwise"},
    {"type": "softmax", "output_norm": True, "output_gate": "elementwise"},
]
# Per-layer layouts of the 2-layer test models (``position_encoding=[layer_0, layer_1]``): a rotary layer beside a
# score bias; Llama 4's NoPE layer with its temperature (a step every 4 positions, so the tests see it) beside a
# content term with a value term; a score bias beside a layer term that keeps per-layer cache state (decoder).
LAYOUTS = [
    ["rope", "t5"],
    [{"type": "none", "attn_temperature_tuning": True, "floor_scale": 4}, "shaw"],
    ["alibi", "fox"],
]
# FoX-Pro: fox with every piece of the reference's Pro block on.
FOX_PRO = {
    "type": "fox",
    "use_qk_norm": True,
    "use_output_gate": True,
    "use_output_norm": True,
    "use_k_shift": True,
    "use_v_shift": True,
}
# Options that make a scheme another formula, run through the same properties as the registry's names.
SCHEME_VARIANTS = [{"type": "rope", "vo_rope": True}, FOX_PRO]
COMBOS = [(scheme, "softmax") for scheme in SCHEMES + SCHEME_VARIANTS + LAYOUTS] + [
    (scheme, normalizer)
    for normalizer in [name for name in NORMALIZERS if name != "softmax"] + NORMALIZER_VARIANTS
    for scheme in REPRESENTATIVE_SCHEMES
]
VOCAB = 61
HIDDEN, HEADS, HEAD_DIM = 32, 4, 8  # the width of make_config's models


# The stock config fields of make_config's models, by family.
TINY_FIELDS = {
    "bert": dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=48,
        max_position_embeddings=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.2,  # peaky attention, so that positions visibly matter
    ),
    "gpt2": dict(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=HEADS,
        n_positions=40,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    ),
}

# The stock config fields of a tiny Llama-family decoder (grouped-query attention), as wide as make_config's models.
TINY_LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=2,  # grouped-query attention
    intermediate_size=48,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def make_config(family: str, position_encoding="learned", attention_normalizer="softmax", **overrides):
    """A PosEnc config of the family (``"bert"``, else GPT-2) with :data:`TINY_FIELDS`, ``overrides`` on top."""
    config_class = hf_posenc.PosEncBertConfig if family == "bert" else hf_posenc.PosEncGPT2Config
    kwargs = {**TINY_FIELDS["bert" if family == "bert" else "gpt2"], **overrides}
    return config_class(position_encoding=position_encoding, attention_normalizer=attention_normalizer, **kwargs)


def stock_attention_config(config_class: type, **fields) -> transformers.PretrainedConfig:
    """A stock Llama-style attention's config (``config_class``) as wide as :func:`make_config`'s models (biased
    projections, one key-value head per query head), on eager; ``fields`` add to it or replace."""
    width = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM)
    config = config_class(**{**width, "attention_bias": True, **fields})
    config._attn_implementation = "eager"
    return config


def make_model(family: str, position_encoding="learned", attention_normalizer="softmax", attn="eager", seed=0, **kw):
    """An eval-mode LM of the family (MLM for bert, CLM for gpt2) with seeded random weights."""
    torch.manual_seed(seed)
    config = make_config(family, position_encoding, attention_normalizer, **kw)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=attn).eval()
    perturb_position_parameters(model)
    return model


# Matrices a recurrence or an ODE applies to the position vector again and again: N(0, 1) entries would make those
# dynamics chaotic (no trained model is), amplifying any rounding past every tolerance; they get N(0, 1/fan_in).
ITERATED_MATRICES = (".transition.weight", ".inner.weight", ".outer.weight")


def perturb_position_parameters(model: torch.nn.Module) -> None:
    """Give zero- or small-initialised position parameters (a T5 table, CoPE's per-layer embeddings) values large
    enough to matter in tests. Linear layers keep their init (std ``initializer_range``, 0.2 here): N(0, 1) weights
    would give scores in the hundreds."""
    with torch.no_grad():
        linear = {
            f"{name}.{p}"
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
            for p, _ in m.named_parameters(recurse=False)
        }
        t5_tables = {
            f"{name}.relative_attention_steps.weight": m
            for name, m in model.named_modules()
            if hasattr(m, "store_bias")
        }
        for name, param in model.named_parameters():
            if ".position_encoding." not in f".{name}" and ".position_term." not in name:
                continue
            if name.endswith(ITERATED_MATRICES):
                param.normal_(0.0, param.shape[-1] ** -0.5)
            elif name in t5_tables:  # t5 stores steps: N(0, 1) bias values, not a random walk
                t5_tables[name].store_bias(torch.empty_like(param).normal_(0.0, 1.0))
            elif name not in linear:
                param.normal_(0.0, 1.0)


def cache_of(output) -> transformers.Cache | None:
    """The KV cache a model output carries, under the installed Transformers' name (``cache`` from 5.24 on)."""
    return getattr(output, CACHE_NAME)


def with_cache(cache) -> dict:
    """The keyword argument that hands a model its KV cache, under the installed Transformers' name."""
    return {CACHE_NAME: cache}


def forward_in_two_chunks(
    model, ids: torch.Tensor, split: int
) -> tuple[torch.Tensor, torch.Tensor, transformers.Cache]:
    """The logits of ``ids`` fed in two chunks (the first ``split`` tokens, then the rest through the KV cache),
    those of one forward of the whole sequence, and the cache the chunks filled."""
    with torch.no_grad():
        first = model(ids[:, :split], use_cache=True)
        cache = cache_of(first)
        second = model(ids[:, split:], **with_cache(cache), use_cache=True)
        full = model(ids).logits
    return torch.cat([first.logits, second.logits], 1), full, cache


def enable_activation_checkpointing(model, use_reentrant: bool) -> bool:
    """Transformers' activation checkpointing under the installed version's name (``activation_checkpointing_enable``
    from 5.23 on, which deprecates ``gradient_checkpointing_enable``); returns whether the model reports it on."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model.is_activation_checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.is_gradient_checkpointing


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def left_padded_prompt(length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of two prompts and their attention mask, the second prompt left-padded by 2 (as generate expects)."""
    prompt = random_ids(2, length, seed=3)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0
    return prompt, attention_mask


def generate_kwargs() -> dict:
    """Greedy generation of 8 new tokens, with their scores."""
    return dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)


def assert_same_generation(first, second) -> None:
    """Two generate outputs (``return_dict_in_generate``) with the same tokens and, within tolerance, scores."""
    assert torch.equal(first.sequences, second.sequences)
    for a, b in zip(first.scores, second.scores, strict=True):  # -inf where min_new_tokens bans EOS
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def assert_generates_with_cache_as_without(model, prompt: torch.Tensor, attention_mask: torch.Tensor, **cache) -> None:
    """:func:`generate_kwargs`' generation with the KV cache (``cache``: its ``cache_implementation``, say) gives the
    tokens and scores of generation without one."""
    kwargs = dict(attention_mask=attention_mask, **generate_kwargs())
    cached = model.generate(prompt, use_cache=True, **cache, **kwargs)
    assert_same_generation(cached, model.generate(prompt, use_cache=False, **kwargs))


def supports(family: str, scheme: str | dict | list) -> bool:
    """Whether the family has a form for the scheme (a name or spec), or for every layer's of a per-layer list."""
    if isinstance(scheme, list):
        return all(supports(family, layer) for layer in scheme)
    name = scheme if isinstance(scheme, str) else scheme["type"]
    return name in (ENCODER_SCHEMES if family == "bert" else DECODER_SCHEMES)


def layout_schemes(scheme: str | dict | list) -> list[str]:
    """The scheme names a position encoding (a name, a spec or a per-layer list) runs."""
    layers = scheme if isinstance(scheme, list) else [scheme]
    return [layer if isinstance(layer, str) else layer["type"] for layer in layers]


def normalizer_supports(family: str, normalizer: str | dict) -> bool:
    """Whether the normalizer (a name or a spec) has a form for the family (``stick_breaking`` is causal: decoders
    only)."""
    name = normalizer if isinstance(normalizer, str) else normalizer["type"]
    return ("encoder" if family == "bert" else "decoder") in NORMALIZER_CATALOGUE[name]["families"]


def family_combos(combos: list[tuple[str, str]]) -> list:
    """``(family, scheme, normalizer)`` for each combination and each family that has a form for both the scheme and
    the normalizer."""
    return [
        (family, *combo)
        for family in FAMILIES
        for combo in combos
        if supports(family, combo[0]) and normalizer_supports(family, combo[1])
    ]


def combos_in_turn_by_family(combos: list[tuple[str, str]]) -> list:
    """``(family, scheme, normalizer)`` with each combination in one family: the encoder and the decoder in turn, the
    decoder where the encoder has no form. Of ``COMBOS``: every scheme once, every normalizer with its representative
    absolute and relative scheme (one per family), each family with a spread of both; for properties whose code path
    the scheme and the normalizer decide, not the family."""
    in_turn = [FAMILIES[index % len(FAMILIES)] for index in range(len(combos))]
    return [
        (family if supports(family, combo[0]) and normalizer_supports(family, combo[1]) else "gpt2", *combo)
        for family, combo in zip(in_turn, combos, strict=True)
    ]


def pytest_make_parametrize_id(config, val, argname):
    """A spec dict's test id names its type and options (``softmax-sink=learned``), not ``normalizer68``; a
    per-layer list joins its layers' (``rope+t5``)."""
    if isinstance(val, dict) and "type" in val:
        return "-".join([str(val["type"]), *(f"{key}={value}" for key, value in val.items() if key != "type")])
    if isinstance(val, list) and val and all(isinstance(layer, (str, dict)) for layer in val):
        return "+".join(pytest_make_parametrize_id(config, layer, argname) or layer for layer in val)
    return None


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def assert_flex_training_step_equals_eager(
    models: dict, ids, attention_mask, atol: float, rtol: float, position_ids=None
) -> dict[str, torch.Tensor]:
    """The MLM/LM loss and every parameter's gradient of one training step of ``models["flex_attention"]`` against
    ``models["eager"]`` (same weights). Returns each model's logits, by backend."""
    results, logits = {}, {}
    for attn, model in models.items():
        output = model(ids, attention_mask=attention_mask, position_ids=position_ids, labels=ids)
        output.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results[attn], logits[attn] = (output.loss.detach(), grads), output.logits.detach()
    (eager_loss, eager_grads), (flex_loss, flex_grads) = results["eager"], results["flex_attention"]
    torch.testing.assert_close(flex_loss, eager_loss, atol=atol, rtol=atol)  # the loss: one scalar, atol both ways
    assert flex_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, atol=atol, rtol=rtol, msg=name)
    return logits


def console_script() -> str:
    """The ``hf-posenc`` script that ``pip install`` wrote (``[project.scripts]``): beside this Python, or on PATH."""
    script = Path(sysconfig.get_path("scripts")) / "hf-posenc"
    found = str(script) if script.is_file() else shutil.which("hf-posenc")
    if found is None:
        pytest.fail("the hf-posenc console script is not installed: pip install -e .")
    return found


def write_corpus_slice(path: Path, lines: int = 1000) -> Path:
    """The embedded corpus's first ``lines`` lines written to ``path``, a ``--train_file`` for the recipe tests that
    train several runs (1,000 lines are 56 kB of the 0.9 MB corpus, which each run would tokenise and score)."""
    from hf_posenc_recipes.pretrain import embedded_corpus_file  # the recipes' extras, only where a test uses it

    path.write_text("".join(embedded_corpus_file().read_text().splitlines(keepends=True)[:lines]))
    return path


def load_benchmark(monkeypatch, name: str) -> types.ModuleType:
    """The script ``benchmarks/<name>.py`` imported as the module ``name``, with ``benchmarks/`` on ``sys.path`` as
    when it runs (its shared helpers, and spawned workers that import it by name), both undone after the test."""
    folder = ROOT / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_command(command: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """A command as a user runs it, with this checkout's code (``CLI_ENV``)."""
    return subprocess.run(command, capture_output=True, text=True, env=CLI_ENV, cwd=cwd, timeout=timeout)


@pytest.fixture
def uncompiled_flex(monkeypatch):
    """FlexAttention's uncompiled path in place of the compiled kernel: the same semantics, the log-sum-exp on CPU,
    any head width, no compile per combination. Returns the list of its calls (each call's ``block_mask``)."""
    calls = []

    def flex(*args, **kwargs):
        calls.append(kwargs.get("block_mask"))
        return flex_attention(*args, **kwargs)

    monkeypatch.setattr(attention_backends, "flex_returns_lse", lambda device: True)
    monkeypatch.setattr(attention_backends, "FLEX_CPU_MIN_HEAD_DIM", 0)
    monkeypatch.setattr(attention_backends, "_compiled_flex_attention", lambda *region: flex)
    for scheme_class in POSITION_ENCODINGS.values():
        monkeypatch.setattr(scheme_class, "flex_compiles_on_cpu", True)
    return calls


@pytest.fixture
def flex_trained_on_cpu(monkeypatch, request):
    """Training steps through FlexAttention compiled by ``torch.compile`` (``backend="aot_eager"``): dynamo and AOT
    autograd trace the operator as for the CUDA kernel, and its own backward (the CPU reference of the kernel's, with
    the gradients of the score_mod's captured tables and of the log-sum-exp) runs in place of the Triton one. CPU
    FlexAttention refuses gradients at its Python entry, which is bypassed; the compiled operator underneath computes
    them. Returns the list of the regions compiled."""
    monkeypatch.setattr(torch.nn.attention.flex_attention, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(attention_backends, "flex_refusal", lambda *args, **kwargs: [])
    monkeypatch.setattr(score_bias_encodings, "flex_compiles_length_sized_tables", lambda device: True)
    regions = []

    def compiled_for(grad_enabled, region, dynamic):  # as the library compiles a region, on aot_eager
        regions.append(region)
        if attention_backends.COMPILE_ISOLATES_RECOMPILES:
            return torch.compile(
                flex_attention, backend="aot_eager", fullgraph=True, dynamic=False, isolate_recompiles=True
            )
        region_flex = attention_backends._region_flex_attention(region)
        return torch.compile(region_flex, backend="aot_eager", fullgraph=True, dynamic=False)

    monkeypatch.setattr(attention_backends, "_compiled_flex_attention", functools.cache(compiled_for))
    monkeypatch.setattr(attention_backends, "_warn_unfused_flex", pytest.fail)  # no silent uncompiled fallback
    # dynamo remembers the sizes it saw per function, whatever the backend: forget them, or a later CPU compile of
    # FlexAttention starts with symbolic sizes, which torch 2.13's CPU template cannot compile for some score_mods
    request.addfinalizer(torch._dynamo.reset)
    return regions
