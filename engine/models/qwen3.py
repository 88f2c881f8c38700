"""Qwen3 (`model_type: qwen3`): Llama with an RMSNorm over each head's query and key before
rotary (`q_norm`, `k_norm`), `head_dim` apart from hidden / heads, tied or untied embeddings,
`attention_bias` on all four projections, and sliding layers as Qwen2 decides them."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.llama import activation, decoder_config, layer_types_windows
from engine.models.traits import SILU, FamilyTraits


def qwen3_from_dict(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    traits = FamilyTraits(
        family="qwen3",
        qkv_bias=bias,
        output_bias=bias,
        qk_norm=True,
        layer_attention=layer_types_windows(raw),
    )
    return decoder_config(raw, traits, activation=activation(raw, "hidden_act", {"silu": SILU}))
