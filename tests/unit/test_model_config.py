"""ModelConfig reads Hugging Face config.json and refuses what the engine does not implement."""

from __future__ import annotations

from typing import Any

import pytest

from engine.models.config import Llama3RopeScaling, ModelConfig


def llama_config(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "hidden_act": "silu",
    }
    raw.update(overrides)
    return raw


def test_reads_fields_and_defaults_head_dim() -> None:
    config = ModelConfig.from_dict(llama_config())
    assert config.head_dim == 8
    assert config.num_query_groups == 4
    assert (config.rope_theta, config.rms_norm_eps, config.tie_word_embeddings) == (500000.0, 1e-5, True)
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_multi_head_when_kv_heads_missing_and_rope_parameters_of_transformers_5() -> None:
    raw = llama_config(rope_parameters={"rope_type": "default", "rope_theta": 1234.0}, head_dim=16)
    del raw["num_key_value_heads"]
    config = ModelConfig.from_dict(raw)
    assert (config.num_key_value_heads, config.head_dim, config.rope_theta) == (8, 16, 1234.0)


def test_llama3_rope_scaling() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = ModelConfig.from_dict(llama_config(rope_scaling=scaling))
    assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, original_max_position_embeddings=1024)
    assert ModelConfig.from_dict(llama_config()).rope_scaling is None


def test_mistral_without_sliding_window_is_llama() -> None:
    assert (
        ModelConfig.from_dict(llama_config(model_type="mistral", sliding_window=None)).model_type == "mistral"
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"eos_token_id": 100}, "eos_token_id"),
    ],
)
def test_refusals_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(llama_config(**overrides))


LFM2_RAW = {
    "model_type": "lfm2",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "norm_eps": 1e-5,
    "conv_L_cache": 3,
    "block_auto_adjust_ff_dim": True,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 16,
}


def test_lfm2_layer_types_and_adjusted_feed_forward() -> None:
    config = ModelConfig.from_dict({**LFM2_RAW, "full_attn_idxs": [1]})
    assert config.layer_types == ("conv", "full_attention", "conv")
    assert config.attention_layer_indices == (1,) and config.conv_layer_indices == (0, 2)
    assert config.num_kv_layers == 1 and config.is_hybrid and config.state_width == 2
    assert config.intermediate_size == 48  # int(2 * 64 / 3) = 42, up to a multiple of 16
    assert config.tie_word_embeddings and config.rope_theta == 1000000.0 and config.head_dim == 8


def test_lfm2_refusals_name_the_field() -> None:
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**LFM2_RAW, "layer_types": ["conv", "mamba", "full_attention"]})
    with pytest.raises(ValueError, match="conv_L_cache"):
        ModelConfig.from_dict({**LFM2_RAW, "full_attn_idxs": [0], "conv_L_cache": 1})
    with pytest.raises(ValueError, match="at least one full_attention"):
        ModelConfig.from_dict({**LFM2_RAW, "full_attn_idxs": []})
