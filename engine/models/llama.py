"""Llama (`model_type: llama`), and the config fields every Llama-like family shares.

`decoder_config` reads what the common decoder needs from a Hugging Face config.json; each family
module calls it with its traits after refusing the fields it does not implement.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.models.config import ModelConfig, first_token_id, parse_rope, refuse_unless
from engine.models.traits import LLAMA_TRAITS, SILU, AttentionKind, FamilyTraits

# Fields that Llama-like configs may set to something the engine does not compute.
COMMON_REFUSALS: tuple[tuple[str, tuple[object, ...]], ...] = (
    ("mlp_bias", (False, None)),
    ("pretraining_tp", (1, None)),
    ("attn_logit_softcapping", (None,)),
)


def llama_from_dict(raw: dict[str, Any]) -> ModelConfig:
    refuse_unless(raw, "attention_bias", (False, None))
    refuse_unless(raw, "sliding_window", (None,))
    return decoder_config(raw, LLAMA_TRAITS, activation=activation(raw, "hidden_act", {"silu": SILU}))


def decoder_config(
    raw: dict[str, Any],
    traits: FamilyTraits,
    *,
    activation: str,
    rope: tuple[float, Any] | None = None,
    default_rms_norm_eps: float = 1e-6,
    default_tie_word_embeddings: bool = False,
) -> ModelConfig:
    """The common fields; `rope` (theta, scaling) overrides the config's own rope fields."""
    for name, allowed in COMMON_REFUSALS:
        refuse_unless(raw, name, allowed)
    num_attention_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    max_position_embeddings = int(raw.get("max_position_embeddings", 2048))
    rope_theta, rope_scaling = parse_rope(raw, max_position_embeddings) if rope is None else rope
    traits = replace(traits, activation=activation)
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_attention_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_attention_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", default_rms_norm_eps)),
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", default_tie_word_embeddings)),
        rope_scaling=rope_scaling,
        bos_token_id=first_token_id(raw.get("bos_token_id")),
        eos_token_id=first_token_id(raw.get("eos_token_id")),
        model_type=str(raw.get("model_type", "llama")),
        traits=traits,
    )


def activation(raw: dict[str, Any], field: str, supported: dict[str, str]) -> str:
    """The engine's name for the config's activation `field`; anything else is refused."""
    name = raw.get(field, next(iter(supported)))
    if name not in supported:
        raise ValueError(f"{field}={name!r} is not supported (supported: {tuple(supported)})")
    return supported[name]


def uniform_window(raw: dict[str, Any], num_layers: int) -> tuple[AttentionKind, ...]:
    """Every layer sliding over `sliding_window` when it is set (Mistral, Phi-3, Qwen3-MoE), else ()."""
    window = raw.get("sliding_window")
    if window is None:
        return ()
    return (AttentionKind(sliding_window=int(window)),) * num_layers


def layer_types_windows(raw: dict[str, Any]) -> tuple[AttentionKind, ...]:
    """Qwen2 / Qwen3: `layer_types` (sliding_attention or full_attention) with `sliding_window`
    applied only when `use_sliding_window` is set, as their configs decide; when layer_types is
    absent, the layers from `max_window_layers` on slide."""
    num_layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first_sliding = int(raw.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if window is not None and index >= first_sliding else "full_attention"
            for index in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (sliding_attention, full_attention)")
    if "sliding_attention" not in layer_types:
        return ()
    if window is None:
        raise ValueError(
            "layer_types has sliding_attention layers but sliding_window is unset (use_sliding_window)"
        )
    return tuple(
        AttentionKind(sliding_window=int(window)) if kind == "sliding_attention" else AttentionKind()
        for kind in layer_types
    )
