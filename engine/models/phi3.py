"""Phi-3 (`model_type: phi3`): Llama with one fused `qkv_proj` ([q | k | v] rows) and one fused
`gate_up_proj` ([gate | up] rows), every layer sliding over `sliding_window` when set.

Refused with the field named: rope_scaling / rope_parameters of type longrope or su (the 128k
variants), partial_rotary_factor (Phi-4-mini)."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.llama import activation, decoder_config, uniform_window
from engine.models.traits import SILU, FamilyTraits


def phi3_from_dict(raw: dict[str, Any]) -> ModelConfig:
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={raw['partial_rotary_factor']} is not supported")
    traits = FamilyTraits(
        family="phi3",
        fused_qkv=True,
        fused_gate_up=True,
        layer_attention=uniform_window(raw, int(raw["num_hidden_layers"])),
    )
    return decoder_config(
        raw, traits, activation=activation(raw, "hidden_act", {"silu": SILU}), default_rms_norm_eps=1e-5
    )
