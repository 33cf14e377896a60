"""Canon layers (``canon_layers``, ``canon_kernel_size``; Allen-Zhu 2025, arXiv 2512.17351): each layer's input and
output against a hand loop of ``h_t + sum_w W[c, w] h_(t-K+1+w)``, each at its insertion point, in both families; the
config's checks; the cache (chunked forwards, static cache, windowed layers, beam search, assisted decoding);
checkpointing, bf16, save/load. Padding, generate with either cache and the backends run in test_model_properties.py
(``ATTENTION_OPTIONS``), remote code in test_attention_options.py."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import cache_of, enable_activation_checkpointing, make_config, make_model, random_ids, with_cache
from torch.nn.attention.flex_attention import create_block_mask

from hf_posenc.canon_layers import CanonLayer


ATOL = 1e-5


def hand_canon(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[b, t, c] = in[b, t, c] + sum_w weight[c, 0, w] in[b, t - K + 1 + w, c]``, zero before the first token,
    one multiply-add at a time."""
    batch, length, channels = inputs.shape
    width = weight.shape[-1]
    out = inputs.clone()
    for b in range(batch):
        for t in range(length):
            for c in range(channels):
                for w in range(width):
                    source = t - width + 1 + w
                    if source >= 0:
                        out[b, t, c] += weight[c, 0, w] * inputs[b, source, c]
    return out


def record(module: torch.nn.Module, seen: dict, name: str, kind: str = "both") -> torch.utils.hooks.RemovableHandle:
    """Keep ``module``'s first positional input and its output (the first of a tuple) under ``name``."""

    def hook(_, args, output):
        if kind in ("both", "input"):
            seen[f"{name}.in"] = args[0]
        if kind in ("both", "output"):
            seen[f"{name}.out"] = output[0] if isinstance(output, tuple) else output

    return module.register_forward_hook(hook)


def gpt2_points(model) -> dict[str, torch.nn.Module]:
    block = model.transformer.h[1]
    return {"A": block.canon_a, "B": block.attn.canon_b, "C": block.canon_c, "D": block.mlp.canon_d}


def bert_points(model) -> dict[str, torch.nn.Module]:
    layer = model.bert.encoder.layer[1]
    return {
        "A": layer.attention.canon_a,
        "B": layer.attention.self.canon_b,
        "C": layer.canon_c,
        "D": layer.intermediate.canon_d,
    }


@pytest.mark.parametrize(
    ("family", "kernel_size", "use_cache"),
    [("gpt2", 4, True), ("gpt2", 4, False), ("bert", 3, False), ("gpt2", 2, True)],
)
def test_each_canon_layer_is_a_causal_depthwise_convolution_at_its_insertion_point(family, kernel_size, use_cache):
    """Layer 1's four canon layers: output = the hand loop of their input; and each input is what the paper's point
    reads (A: the attention's input, GPT-2's ln_1 output / BERT's layer input; B: q|k|v as projected; C: the MLP's
    input; D: the up projection's output), each output what the next module reads. Kernel 2 is a token shift. The
    decoder with a cache reads the window from the inputs it stores; without one, from zero padding."""
    model = make_model(family, "none", canon_layers="ABCD", canon_kernel_size=kernel_size)
    points = gpt2_points(model) if family == "gpt2" else bert_points(model)
    seen, handles = {}, []
    for point, module in points.items():
        handles.append(record(module, seen, point))
    if family == "gpt2":
        block = model.transformer.h[1]
        handles += [
            record(block.ln_1, seen, "ln_1", "output"),
            record(block.attn, seen, "attn", "input"),
            record(block.attn.c_attn, seen, "c_attn", "output"),
            record(block.ln_2, seen, "ln_2", "output"),
            record(block.mlp, seen, "mlp", "input"),
            record(block.mlp.c_fc, seen, "c_fc", "output"),
            record(block.mlp.c_proj, seen, "c_proj", "input"),
        ]
    else:
        layer = model.bert.encoder.layer[1]
        handles += [
            record(layer.attention, seen, "attention"),
            record(layer.attention.self, seen, "self", "input"),
            record(layer.attention.self.query, seen, "query", "output"),
            record(layer.attention.self.key, seen, "key", "output"),
            record(layer.attention.self.value, seen, "value", "output"),
            record(layer.intermediate, seen, "intermediate"),
            record(layer.intermediate.dense, seen, "dense", "output"),
        ]
    with torch.no_grad():
        model(random_ids(2, 6), **({"use_cache": use_cache} if family == "gpt2" else {}))
    for handle in handles:
        handle.remove()
    for point, module in points.items():
        assert module.weight.shape == (module.channels, 1, kernel_size)
        torch.testing.assert_close(
            seen[f"{point}.out"], hand_canon(seen[f"{point}.in"], module.weight), atol=ATOL, rtol=0
        )
    if family == "gpt2":
        reads = {"A": "ln_1.out", "B": "c_attn.out", "C": "ln_2.out", "D": "c_fc.out"}
        feeds = {"A": seen["attn.in"], "C": seen["mlp.in"], "D": None}
        activation = model.transformer.h[1].mlp.act
        torch.testing.assert_close(seen["c_proj.in"], activation(seen["D.out"]))
    else:
        qkv = torch.cat([seen["query.out"], seen["key.out"], seen["value.out"]], -1)
        seen["qkv"] = qkv
        reads = {"A": "attention.in", "B": "qkv", "C": "attention.out", "D": "dense.out"}
        feeds = {"A": seen["self.in"], "C": seen["intermediate.in"], "D": None}
        activation = model.bert.encoder.layer[1].intermediate.intermediate_act_fn
        torch.testing.assert_close(seen["intermediate.out"], activation(seen["D.out"]))
    for point, source in reads.items():
        torch.testing.assert_close(seen[f"{point}.in"], seen[source], atol=0, rtol=0, msg=point)
    for point, target in feeds.items():
        if target is not None:
            torch.testing.assert_close(seen[f"{point}.out"], target, atol=0, rtol=0, msg=point)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_canon_layers_change_the_model_and_only_through_their_weights(family):
    """The same weights without canon layers: equal outputs once the canon weights are zero, different with their
    init (the option is not silently ignored)."""
    ids = random_ids(2, 8)
    canon = make_model(family, "none", canon_layers="ABCD")
    plain = make_model(family, "none")
    assert not any("canon" in name for name, _ in plain.named_parameters())
    canon_names = [name for name, _ in canon.named_parameters() if "canon" in name]
    assert len(canon_names) == 4 * 2
    missing, unexpected = plain.load_state_dict(canon.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == sorted(canon_names)
    with torch.no_grad():
        assert not torch.allclose(canon(ids).logits, plain(ids).logits, atol=1e-3)
        for module in canon.modules():
            if isinstance(module, CanonLayer):
                module.weight.zero_()
        torch.testing.assert_close(canon(ids).logits, plain(ids).logits, atol=ATOL, rtol=0)


def test_canon_weights_start_as_a_depthwise_conv1d_does():
    """``nn.Conv1d``'s default (the reference's ``reset_parameters``): ``U(-1/sqrt(K), 1/sqrt(K))``, not the family's
    ``N(0, initializer_range)``."""
    model = make_model("gpt2", "none", canon_layers="D", canon_kernel_size=4, n_embd=64, initializer_range=0.02)
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, CanonLayer)])
    bound = 1 / math.sqrt(4)
    assert weights.abs().max() <= bound
    assert weights.numel() == 2 * 256 * 4
    assert abs(weights.std().item() - bound / math.sqrt(3)) < 0.02  # U(-b, b): std b / sqrt(3), 0.29 here


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"canon_layers": "ABE"}, "canon_layers must be None"),
        ({"canon_layers": "AA"}, "distinct insertion points"),
        ({"canon_layers": 4}, "'A', 'B', 'C', 'D'"),
        ({"canon_layers": "AB", "canon_kernel_size": 1}, "canon_kernel_size must be an integer >= 2"),
        ({"canon_layers": "AB", "canon_kernel_size": "4"}, "got '4'"),
        ({"canon_kernel_size": 3}, "has no effect without canon_layers"),
        ({"canon_set": "ABCD"}, r"Unknown config field\(s\) \['canon_set'\]"),
        ({"canon_layer": "ABCD"}, r"\['canon_layers', 'canon_kernel_size'\]"),
        ({"canon_layers": "A", "canon_kernel_size": 5, "sliding_window": 4}, "window of at least 5 tokens"),
    ],
)
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bad_canon_fields_are_refused_by_name(family, fields, message):
    with pytest.raises(ValueError, match=message):
        make_config(family, **fields)


def test_canon_layers_are_stored_in_the_papers_order_and_off_by_default():
    assert make_config("gpt2", canon_layers="ca").canon_layers == "AC"
    assert make_config("bert", canon_layers="").canon_layers is None
    config = make_config("gpt2")
    assert config.canon_layers is None and config.canon_kernel_size == 4


@pytest.mark.parametrize("parallelism", ["tensor", "context"])
def test_canon_layers_refuse_tensor_and_context_parallelism_by_name(parallelism):
    model = make_model("gpt2", "rope", canon_layers="AC")
    with pytest.raises(ValueError, match=f"canon_layers 'AC' refuse {parallelism} parallelism"):
        model.check_parallelism(parallelism)
    make_model("gpt2", "rope").check_parallelism(parallelism)  # the same model without them runs


@pytest.mark.parametrize("cache_class", [transformers.DynamicCache, transformers.StaticCache])
def test_chunked_cached_forwards_equal_one_forward(cache_class):
    """Chunks of 5, 1, 1 and 3 tokens (a step reads the K - 1 inputs before it from the cache, across chunks), with a
    left-padded row: the logits of one forward."""
    model = make_model("gpt2", "none", canon_layers="ABCD")
    ids = random_ids(2, 10, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    sizes = {"max_cache_len": 12} if cache_class is transformers.StaticCache else {}
    cache = cache_class(config=model.config, **sizes)
    pieces = []
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        for start, stop in [(0, 5), (5, 6), (6, 7), (7, 10)]:
            output = model(
                ids[:, start:stop],
                attention_mask=mask[:, :stop],
                position_ids=positions[:, start:stop],
                use_cache=True,
                **with_cache(cache),
            )
            cache = cache_of(output)
            pieces.append(output.logits)
    visible = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[visible], full[visible], atol=ATOL, rtol=1e-4)


def test_beam_search_and_bert_decoding_with_cache_equal_without():
    """Beam search reorders the cached inputs with the keys; a causal BERT keeps them as GPT-2 does."""
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    prompt = random_ids(2, 5, seed=3)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0
    gpt2 = make_model("gpt2", "rope", canon_layers="ABCD", attn="sdpa")
    beams = dict(greedy, num_beams=2, attention_mask=attention_mask)
    assert torch.equal(gpt2.generate(prompt, **beams), gpt2.generate(prompt, use_cache=False, **beams))
    torch.manual_seed(0)
    config = make_config("bert", "rope", canon_layers="ABCD", is_decoder=True, bos_token_id=1, eos_token_id=2)
    bert = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert torch.equal(bert.generate(prompt, **greedy), bert.generate(prompt, use_cache=False, **greedy))


def test_assisted_decoding_crops_the_cached_inputs_as_greedy_decoding():
    """Prompt lookup proposes tokens and the cache is cropped back where they are rejected."""
    model = make_model("gpt2", "none", canon_layers="ABCD", attn="sdpa")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    greedy = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **greedy), model.generate(prompt, **greedy))


@pytest.mark.parametrize(("family", "use_reentrant"), [("gpt2", True), ("bert", False)])
def test_gradient_checkpointing_gives_the_same_gradients(family, use_reentrant):
    ids = random_ids(2, 8)
    grads = []
    for checkpointing in (False, True):
        model = make_model(family, "rope", attn="sdpa", canon_layers="ABCD").train()
        if checkpointing:
            assert enable_activation_checkpointing(model, use_reentrant)
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any("canon" in name for name in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_bfloat16_matches_float32(family):
    model = make_model(family, "none", attn="sdpa", canon_layers="ABCD")
    ids = random_ids(2, 8)
    with torch.no_grad():
        reference = model(ids).logits
        low = model.to(torch.bfloat16)(ids).logits
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, atol=0.2, rtol=0.05)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_save_load_round_trip_is_exact(family, tmp_path):
    """(Remote code without hf_posenc: ``test_attention_options``.)"""
    model = make_model(family, "none", attn="sdpa", canon_layers="ABCD", canon_kernel_size=3)
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert (reloaded.config.canon_layers, reloaded.config.canon_kernel_size) == ("ABCD", 3)
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    ("window", "cache_implementation"), [({"sliding_window": 4}, "dynamic"), ({"attention_chunk_size": 4}, "static")]
)
def test_every_layer_windowed_generates_past_the_window_with_cache_as_without(window, cache_implementation):
    """Each layer's cached inputs are kept as its keys, in a window of 4 (the K - 1 = 3 a step reads)."""
    model = make_model("gpt2", "rope", attn="sdpa", canon_layers="ABCD", **window)
    prompt = random_ids(2, 6, seed=3)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0
    greedy = dict(attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, cache_implementation=cache_implementation, **greedy)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **greedy))


def test_a_block_mask_with_canon_layers_is_refused():
    model = make_model("gpt2", "none", attn="flex_attention", canon_layers="A")
    block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 6, 6, device="cpu")
    with pytest.raises(ValueError, match="a BlockMask does not say which tokens are padding"):
        model(random_ids(1, 6), attention_mask=block_mask)
