"""The libraries users pair with Transformers, run for real on tiny models, offline: sentence-transformers (encode,
train, save, reload) over a saved PosEnc BERT and saved retrofitted stock BERT and ModernBERT, and TRL's
``SFTTrainer`` with and without a PEFT LoRA config on a PosEnc and a retrofitted GPT-2 and a retrofitted Qwen3.
Tokens are bytes (``ByT5Tokenizer``, built without files, as the pretraining recipes do)."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_config

import hf_posenc


SENTENCES = ["Emma Woodhouse, handsome", "clever, and rich", "a comfortable home", "and happy disposition"]
PARAPHRASES = ["Emma, handsome", "rich and clever", "a pleasant home", "a happy temper"]


def byte_tokenizer() -> transformers.ByT5Tokenizer:
    return transformers.ByT5Tokenizer()


def stock_bert(vocab_size: int) -> transformers.BertModel:
    config = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=40, initializer_range=0.2, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertModel(config)


def stock_modernbert(vocab_size: int) -> transformers.ModernBertModel:
    """Local layers of 8 tokens (a window shorter than the sentences) between global ones."""
    config = transformers.ModernBertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, local_attention=8, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
        eos_token_id=1, cls_token_id=1, sep_token_id=1,
    )  # fmt: skip
    return transformers.ModernBertModel(config)


def saved_bert(kind: str, folder) -> str:
    """A tiny encoder with the byte tokenizer, saved: PosEnc BERT (``t5``), a retrofitted stock BERT (``alibi``) or a
    retrofitted stock ModernBERT switched to ``none`` on its global layer (its local layers keep RoPE)."""
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    if kind == "posenc":
        model = hf_posenc.PosEncBertModel(make_config("bert", "t5", vocab_size=len(tokenizer), pad_token_id=0))
    elif kind == "retrofit-modernbert":
        model = hf_posenc.retrofit(stock_modernbert(len(tokenizer)), "none", layers=[0])
    else:
        model = hf_posenc.retrofit(stock_bert(len(tokenizer)), "alibi")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def mean_pooled(model: torch.nn.Module, sentences: list[str]) -> torch.Tensor:
    """Mean of the last hidden states over each sentence's real tokens, computed here from the model itself."""
    batch = byte_tokenizer()(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.mark.parametrize("kind", ["posenc", "retrofit", "retrofit-modernbert"])
def test_sentence_transformers_encodes_trains_saves_and_reloads(kind, tmp_path):
    """sentence-transformers calls the Transformers model's ``forward`` directly (no module hooks): the mean-pooled
    embeddings are those of the model's own outputs, three training steps move the weights, and the saved model
    reloads to the same embeddings."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is a test extra: .[test]")
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model = st.SentenceTransformer(saved_bert(kind, tmp_path / "base"), device="cpu", trust_remote_code=True)
    encoder = model[0].model
    expected_class = {"posenc": hf_posenc.PosEncBertModel, "retrofit": transformers.BertModel}
    assert isinstance(encoder, expected_class.get(kind, transformers.ModernBertModel))
    embeddings = model.encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(embeddings, mean_pooled(encoder.eval(), SENTENCES), atol=1e-5, rtol=1e-5)

    before = {name: param.detach().clone() for name, param in encoder.named_parameters()}
    args = st.SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
    )  # fmt: skip
    data = Dataset.from_dict({"anchor": SENTENCES, "positive": PARAPHRASES})
    loss = MultipleNegativesRankingLoss(model)
    trainer = st.SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    moved = {name for name, param in encoder.named_parameters() if not torch.equal(param, before[name])}
    assert (
        "layers.0.attn.Wqkv.weight" if kind == "retrofit-modernbert" else "encoder.layer.0.attention.self.query.weight"
    ) in moved
    if kind == "posenc":  # the T5 bias table is trained too
        assert "position_encoding.relative_attention_steps.weight" in moved

    model.save(str(tmp_path / "trained"))
    reloaded = st.SentenceTransformer(str(tmp_path / "trained"), device="cpu", trust_remote_code=True)
    trained = model.encode(SENTENCES, convert_to_tensor=True)
    assert not torch.allclose(trained, embeddings, atol=1e-4)
    torch.testing.assert_close(reloaded.encode(SENTENCES, convert_to_tensor=True), trained, atol=1e-6, rtol=1e-6)


def tiny_gpt2(kind: str, vocab_size: int) -> transformers.PreTrainedModel:
    """A tiny LM: PosEnc GPT-2 (``rope``), a retrofitted stock GPT-2 (``alibi``) or a retrofitted stock Qwen3 dropped
    to ``none`` on every layer (DroPE), its QK-norm kept."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0, eos_token_id=1)
    if kind == "posenc":
        return hf_posenc.PosEncGPT2LMHeadModel(make_config("gpt2", "rope", **sizes))
    if kind == "retrofit-qwen3":
        config = transformers.Qwen3Config(
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=48, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        return hf_posenc.retrofit(transformers.Qwen3ForCausalLM(config), "none")
    return hf_posenc.retrofit(transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes, bos_token_id=1)), "alibi")


@pytest.mark.parametrize("kind", ["posenc", "retrofit", "retrofit-qwen3"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trl_sft_trainer_trains_a_gpt2(kind, lora, tmp_path, request):
    """TRL's ``SFTTrainer`` on plain text, two steps: the loss is finite; full fine-tuning moves the model's weights,
    LoRA (``LoraConfig(task_type="CAUSAL_LM")`` alone: PEFT's GPT-2 targets) moves only the adapters. accelerate
    keeps its state (mixed precision included) in process-wide singletons, which the recipes' own Accelerator would
    inherit in this test process: reset after the test."""
    from accelerate.state import AcceleratorState, GradientState

    request.addfinalizer(GradientState._reset_state)
    request.addfinalizer(lambda: AcceleratorState._reset_state(reset_partial_state=True))
    trl = pytest.importorskip("trl", reason="TRL is a test extra: pip install -e .[test]")
    pytest.importorskip("peft", reason="PEFT is a test extra: pip install -e .[test]")
    from datasets import Dataset
    from peft import LoraConfig

    tokenizer = byte_tokenizer()
    model = tiny_gpt2(kind, len(tokenizer))
    before = [(param, param.detach().clone()) for param in model.parameters()]  # PEFT keeps these objects
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
        use_cpu=True, save_strategy="no", logging_steps=1, max_length=32,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": SENTENCES + PARAPHRASES}),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0) if lora else None,
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    adapters = {name: param for name, param in trainer.model.named_parameters() if "lora_" in name}
    assert bool(adapters) == lora
    moved = [not torch.equal(param, value) for param, value in before]
    if lora:
        targets = {"q_proj", "v_proj"} if kind == "retrofit-qwen3" else {"c_attn"}  # PEFT's defaults of the stock type
        assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in adapters} == targets
        assert any(param.abs().sum() > 0 for name, param in adapters.items() if "lora_B" in name)  # B starts at 0
        assert not any(moved)
    else:
        assert sum(moved) > len(moved) // 2
