"""Which module parses which Hugging Face `model_type`: adding a family is one entry here, its
module (a `*_from_dict` that refuses what the engine does not implement and declares its
FamilyTraits) and its tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.models.config import ModelConfig, lfm2_from_dict
from engine.models.gemma3 import gemma3_from_dict
from engine.models.llama import llama_from_dict
from engine.models.mistral import mistral_from_dict
from engine.models.phi3 import phi3_from_dict
from engine.models.qwen2 import qwen2_from_dict
from engine.models.qwen3 import qwen3_from_dict
from engine.models.qwen3_moe import qwen3_moe_from_dict

FAMILIES: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "llama": llama_from_dict,
    "mistral": mistral_from_dict,
    "qwen2": qwen2_from_dict,
    "qwen3": qwen3_from_dict,
    "qwen3_moe": qwen3_moe_from_dict,
    "gemma3_text": gemma3_from_dict,
    "gemma3": gemma3_from_dict,
    "phi3": phi3_from_dict,
    "lfm2": lfm2_from_dict,
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    return FAMILIES[model_type](raw)
