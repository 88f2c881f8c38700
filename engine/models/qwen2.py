"""Qwen2 / Qwen2.5 (`model_type: qwen2`): Llama with biased q/k/v projections, and sliding
layers where `use_sliding_window` and `layer_types` (or `max_window_layers`) say so."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.llama import activation, decoder_config, layer_types_windows
from engine.models.traits import SILU, FamilyTraits


def qwen2_from_dict(raw: dict[str, Any]) -> ModelConfig:
    traits = FamilyTraits(family="qwen2", qkv_bias=True, layer_attention=layer_types_windows(raw))
    return decoder_config(raw, traits, activation=activation(raw, "hidden_act", {"silu": SILU}))
