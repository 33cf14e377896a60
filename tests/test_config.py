"""Config fields, validation errors and the catalogue listings."""

from __future__ import annotations

import json

import pytest
import transformers

import hf_posenc


CONFIG_CLASSES = [hf_posenc.PosEncBertConfig, hf_posenc.PosEncGPT2Config]


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_names_expand_to_full_dicts_with_defaults(config_class):
    config = config_class(position_encoding="t5", attention_normalizer="l2")
    assert config.position_encoding == {
        "type": "t5",
        "num_buckets": 32,
        "max_distance": 128,
        "table_scale": None,
        "init": "reference",
    }
    assert config.attention_normalizer == {
        "type": "l2", "output_gate": None, "output_norm": False, "toeplitz_gate": False, "toeplitz_max_distance": 128
    }  # fmt: skip


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_defaults_are_the_stock_model(config_class):
    config = config_class()
    assert config.position_encoding["type"] == "learned"
    assert config.attention_normalizer == {
        "type": "softmax",
        "sink": None,
        "output_gate": None,
        "output_norm": False,
        "toeplitz_gate": False,
        "toeplitz_max_distance": 128,
    }


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_config_json_stores_the_full_spec(config_class, tmp_path):
    config = config_class(position_encoding={"type": "rope", "theta": 500})
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["position_encoding"] == {
        "type": "rope",
        "theta": 500.0,
        "rotary_fraction": 1.0,
        "kept_frequency_fraction": 1.0,
        "apply_to_value": False,
        "vo_rope": False,
        "scaling": None,
    }
    assert saved["model_type"] == config_class.model_type
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(reloaded) is config_class
    assert reloaded.position_encoding == config.position_encoding


def test_bert_and_gpt2_fields_keep_their_meaning():
    bert = hf_posenc.PosEncBertConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=77)
    gpt2 = hf_posenc.PosEncGPT2Config(n_embd=64, n_head=2, n_positions=77)
    for config in (bert, gpt2):
        assert (config.hidden_size, config.num_attention_heads, config.max_position_embeddings) == (64, 2, 77)
        assert config.position_encoding["max_positions"] == 77
    assert isinstance(bert, transformers.BertConfig) and isinstance(gpt2, transformers.GPT2Config)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("position_encoding", "rop", r"Unknown position_encoding 'rop'; valid choices: \['alibi', .*'rope'"),
        ("attention_normalizer", "relu", r"Unknown attention_normalizer 'relu'; valid choices: \['diff.*'relu"),
        ("attention_normalizer", {"type": "l2", "toeplitz_gate": 1}, r"option 'toeplitz_gate' must be bool, got 1"),
        ("attention_normalizer", {"type": "exp", "toeplitz_max_distance": 0}, r"'toeplitz_max_distance'=0 is out of"),
        ("position_encoding", {"type": "rope", "thta": 1.0}, r"Unknown option\(s\) \['thta'\].*'rotary_fraction'"),
        ("position_encoding", {"type": "alibi", "slope": 1}, r"Unknown option\(s\) \['slope'\].*none"),
        ("position_encoding", {"type": "rope", "theta": "big"}, r"option 'theta' must be float or int, got 'big'"),
        ("position_encoding", {"type": "t5", "num_buckets": True}, r"'num_buckets' must be int, got True"),
        ("position_encoding", {"type": "t5", "num_buckets": 31}, r"'num_buckets'=31 is out of range; valid: an even"),
        ("position_encoding", {"type": "rope", "rotary_fraction": 1.5}, r"'rotary_fraction'=1.5 is out of range"),
        ("position_encoding", {"type": "learned", "max_positions": 0}, r"'max_positions'=0 is out of range"),
        ("position_encoding", {"type": "t5", "max_distance": 16}, r"max_distance=16 must be larger than .* = 16"),
        ("position_encoding", {"type": "t5", "init": "zeros"}, r"'init'='zeros' is out of range; valid: 'refer"),
        ("position_encoding", {"type": "t5", "init": None}, r"option 'init' must be str, got None"),
        ("position_encoding", {"theta": 2.0}, r"has no 'type' key; valid types: \['alibi'"),
        ("position_encoding", 3, r"must be a name or a dict .* got 3"),
        ("attention_normalizer", ["softmax"], r"must be a name or a dict .* got \['softmax'\]"),
    ],
)
@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_bad_values_raise_a_clear_value_error(config_class, field, value, message):
    with pytest.raises(ValueError, match=message):
        config_class(**{field: value})


def test_rope_must_rotate_at_least_two_features():
    config = hf_posenc.PosEncGPT2Config(
        n_embd=32, n_head=4, n_layer=1, position_encoding={"type": "rope", "rotary_fraction": 0.1}
    )
    with pytest.raises(ValueError, match=r"rotary_fraction=0.1 of head_dim=8 rotates 0 features"):
        hf_posenc.PosEncGPT2Model(config)


def test_unsupported_attn_implementation_is_refused():
    config = hf_posenc.PosEncBertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    with pytest.raises(ValueError, match="does not support Flash Attention 2"):
        transformers.AutoModel.from_config(config, attn_implementation="flash_attention_2")


def test_listings_describe_every_scheme_with_options_and_defaults():
    encodings = hf_posenc.list_position_encodings()
    assert {"learned", "sinusoidal", "none", "rope", "t5", "alibi"} <= set(encodings)  # and the schemes of each family
    assert encodings["rope"]["options"]["theta"]["default"] == 10000.0
    relative = {name for name, entry in encodings.items() if entry["relative"]}
    assert {"none", "rope", "t5", "alibi", "kerple", "xpos"} <= relative and not {"learned", "sinusoidal"} & relative
    assert "fire" not in relative  # shift-invariant only below its threshold
    assert encodings["t5"]["backends"] == ["eager", "sdpa", "flex_attention"]
    assert encodings["t5"]["options"] == {
        "num_buckets": {"default": 32, "doc": "number of buckets"},
        "max_distance": {"default": 128, "doc": "distance of the last bucket"},
        "table_scale": {"default": None, "doc": "bias = table_scale * table (None: sqrt(head_dim))"},
        "init": {
            "default": "reference",
            "doc": "'reference': T5's N(0, hidden_size^-1/2) bias values; 'decay': the same, -1 nat per logarithmic "
            "bucket",
        },
    }
    assert all(entry["description"] for entry in encodings.values())
    normalizers = hf_posenc.list_attention_normalizers()
    assert set(normalizers) == {
        "softmax", "l2", "exp", "relu2", "swish_l2", "sigmoid", "ssmax", "softpick", "stick_breaking",
        "differential",
    }  # fmt: skip
    assert normalizers["softmax"]["options"]["sink"]["default"] is None
    assert normalizers["stick_breaking"]["families"] == ["decoder"]
    assert normalizers["l2"]["families"] == ["encoder", "decoder"]
    assert "sqrt" in normalizers["l2"]["description"]
    assert normalizers["l2"]["backends"] == ["eager", "flex_attention"]  # flex where it returns the log-sum-exp
    assert all(entry["options"]["toeplitz_gate"]["default"] is False for entry in normalizers.values())


def test_t5_max_distance_just_past_the_exact_buckets_is_accepted():
    config = hf_posenc.PosEncGPT2Config(position_encoding={"type": "t5", "max_distance": 17})
    assert config.position_encoding["max_distance"] == 17


def test_a_field_reassigned_after_construction_is_resolved_when_the_model_is_built(tmp_path):
    config = hf_posenc.PosEncBertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    config.position_encoding = "rope"
    config.attention_normalizer = {"type": "l2"}
    model = transformers.AutoModel.from_config(config)
    assert model.config.position_encoding == {
        "type": "rope",
        "theta": 10000.0,
        "rotary_fraction": 1.0,
        "kept_frequency_fraction": 1.0,
        "apply_to_value": False,
        "vo_rope": False,
        "scaling": None,
    }
    config.position_encoding = "rotary"
    with pytest.raises(ValueError, match="Unknown position_encoding 'rotary'"):
        transformers.AutoModel.from_config(config)
