"""Configs: HF field names, config.json round trips, and clear errors."""

import json

import pytest

from ms_models import DeepseekV3Config, LlamaConfig, ModelError, Qwen2Config, config_from_dict, load_config, tiny_config
from ms_models.config import CONFIG_CLASSES


@pytest.mark.parametrize("arch", sorted(CONFIG_CLASSES))
def test_round_trip(arch):
    config = tiny_config(arch)
    again = config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.to_dict()["model_type"] == arch


def test_unknown_fields_are_kept():
    data = {**tiny_config("llama").to_dict(), "some_future_field": [1, 2]}
    config = config_from_dict(data)
    assert config.extra["some_future_field"] == [1, 2]
    assert config.to_dict()["some_future_field"] == [1, 2]


def test_rope_parameters_of_transformers_5_are_folded():
    data = tiny_config("llama").to_dict()
    del data["rope_theta"], data["rope_scaling"]
    data["rope_parameters"] = {"rope_theta": 500.0, "rope_type": "linear", "factor": 2.0}
    config = config_from_dict(data)
    assert config.rope_theta == 500.0
    assert config.rope_type == "linear"
    inv, scale = config.rope_inv_freq()
    assert inv[0] == pytest.approx(0.5) and scale == 1.0


def test_defaults_follow_hf():
    assert LlamaConfig(hidden_size=64, num_attention_heads=4).head_dim == 16
    assert Qwen2Config().qkv_bias and not Qwen2Config().o_bias
    assert DeepseekV3Config().qk_head_dim == 192


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(hidden_size=0), "hidden_size=0"),
        (dict(hidden_act="gelu"), "gelu"),
        (dict(rope_scaling={"rope_type": "longrope"}), "longrope"),
    ],
)
def test_bad_llama_config(kwargs, match):
    with pytest.raises(ModelError, match=match):
        LlamaConfig(**{"hidden_size": 64, "num_attention_heads": 4, **kwargs})


def test_bad_deepseek_config():
    with pytest.raises(ModelError, match="n_group=3"):
        tiny_config("deepseek_v3", n_group=3)
    with pytest.raises(ModelError, match="num_experts_per_tok=5"):
        tiny_config("deepseek_v3", num_experts_per_tok=5)


def test_unsupported_model_type_and_missing_file(tmp_path):
    with pytest.raises(ModelError, match="'gpt2'"):
        config_from_dict({"model_type": "gpt2"})
    with pytest.raises(ModelError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.needs_torch
@pytest.mark.parametrize("arch", sorted(CONFIG_CLASSES))
def test_transformers_reads_our_config(arch, tmp_path):
    import transformers

    config = tiny_config(arch)
    config.save(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "tie_word_embeddings"):
        assert getattr(theirs, name) == getattr(config, name)
    assert theirs.rope_parameters["rope_theta"] == config.rope_theta
