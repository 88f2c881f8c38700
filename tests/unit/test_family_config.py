"""Each family module reads its config.json as transformers does, and refuses what the engine does
not compute with one line naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from engine.models.config import ModelConfig
from engine.models.traits import AttentionKind

BASE: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# Gemma 3 270M's config.json as published (older rope fields, pattern 6, window 512).
GEMMA3_270M: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def test_gemma3_270m_reads_as_transformers_does() -> None:
    config = ModelConfig.from_dict(GEMMA3_270M)
    local, full = AttentionKind(512, 10000.0), AttentionKind()
    assert config.traits.layer_attention == ((local,) * 5 + (full,)) * 3
    assert config.rope_theta == 1_000_000.0 and config.head_dim == 256 and config.tie_word_embeddings
    assert config.sliding_windows == (512,) and config.kv_layer_windows[5] is None
    assert config.traits.query_pre_attn_scalar == 256 and config.traits.final_logit_softcapping is None
    wrapped = ModelConfig.from_dict({"model_type": "gemma3", "text_config": GEMMA3_270M})
    assert wrapped.traits == config.traits


def test_qwen2_window_only_when_use_sliding_window() -> None:
    # Qwen2.5 configs carry sliding_window with use_sliding_window false: every layer full.
    off = ModelConfig.from_dict(
        {**BASE, "model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}
    )
    assert off.sliding_windows == () and off.traits.qkv_bias
    on = ModelConfig.from_dict(
        {
            **BASE,
            "model_type": "qwen2",
            "sliding_window": 16,
            "use_sliding_window": True,
            "max_window_layers": 2,
        }
    )
    assert on.kv_layer_windows == (None, None, 16, 16)


@pytest.mark.parametrize(
    ("mlp_only_layers", "step", "sparse"),
    [([], 1, (0, 1, 2, 3)), ([1], 1, (0, 2, 3)), ([], 2, (1, 3)), ([3], 2, (1,))],
)
def test_qwen3_moe_sparse_layers_as_transformers_decides(
    mlp_only_layers: list[int], step: int, sparse: tuple[int, ...]
) -> None:
    raw = {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
    config = ModelConfig.from_dict({**raw, "mlp_only_layers": mlp_only_layers, "decoder_sparse_step": step})
    assert config.traits.moe is not None and config.traits.moe.sparse_layers == sparse
    assert ModelConfig.from_dict({**raw, "num_experts": 0}).traits.moe is None


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            {"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0]}},
            "rope_scaling.rope_type",
        ),
        ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ({**GEMMA3_270M, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({**GEMMA3_270M, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**GEMMA3_270M, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling.rope_type"),
        ({**GEMMA3_270M, "hidden_activation": "gelu"}, "hidden_activation"),
        ({"model_type": "mistral", "attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen2", "layer_types": ["full_attention"] * 3 + ["chunked"]}, "layer_types"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"model_type": "gpt_oss"}, "model_type"),
    ],
)
def test_refusals_name_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict({**BASE, **raw})
