"""Mistral (`model_type: mistral`): Llama whose every layer attends over a sliding window of
`sliding_window` positions when the config sets one (transformers' MistralAttention)."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig, refuse_unless
from engine.models.llama import activation, decoder_config, uniform_window
from engine.models.traits import SILU, FamilyTraits


def mistral_from_dict(raw: dict[str, Any]) -> ModelConfig:
    refuse_unless(raw, "attention_bias", (False, None))
    traits = FamilyTraits(
        family="mistral", layer_attention=uniform_window(raw, int(raw["num_hidden_layers"]))
    )
    return decoder_config(raw, traits, activation=activation(raw, "hidden_act", {"silu": SILU}))
