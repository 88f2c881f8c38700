"""The shape of a decoder, read from a Hugging Face `config.json`.

The common fields are Llama's; how a family differs (biases, extra norms, sliding windows, experts)
is its FamilyTraits (engine/models/traits.py), parsed by the family's module (engine/models/families.py
maps `model_type` to it). LFM2 mixes attention layers with short-convolution layers (`layer_types`); a convolution layer
carries a recurrent state, the last `conv_kernel_size - 1` inputs of its convolution.

Only what the engine implements is accepted: anything else fails at load time with a message that
names the config field, rather than producing a model that silently computes something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.traits import FULL_ATTENTION, LLAMA_TRAITS, AttentionKind, FamilyTraits

ATTENTION_LAYER = "full_attention"
CONV_LAYER = "conv"
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent stretch of the rotary frequencies (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor > 0 or not self.factor > 0:
            raise ValueError(
                "rope llama3 needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
                f"{self.factor}, {self.high_freq_factor}, {self.low_freq_factor}"
            )


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    # Hybrid (lfm2) only: one entry per layer, ATTENTION_LAYER or CONV_LAYER; empty means every
    # layer is attention. conv_kernel_size is LFM2's conv_L_cache.
    layer_types: tuple[str, ...] = ()
    conv_kernel_size: int = 0
    conv_bias: bool = False
    traits: FamilyTraits = LLAMA_TRAITS

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be in [0, vocab_size={self.vocab_size}), got {value}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - {ATTENTION_LAYER, CONV_LAYER})
            if unknown:
                raise ValueError(f"layer_types {unknown} are not supported ({ATTENTION_LAYER}, {CONV_LAYER})")
            if not self.attention_layer_indices:
                raise ValueError("layer_types needs at least one full_attention layer")
        if self.conv_layer_indices and self.conv_kernel_size < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {self.conv_kernel_size}")
        layer_attention = self.traits.layer_attention
        if layer_attention and len(layer_attention) != self.num_hidden_layers:
            raise ValueError(
                f"layer_attention has {len(layer_attention)} entries for {self.num_hidden_layers} layers"
            )
        if layer_attention and self.layer_types:
            raise ValueError("per-layer attention kinds are not supported in a hybrid (layer_types) model")
        moe = self.traits.moe
        if moe is not None and any(not 0 <= index < self.num_hidden_layers for index in moe.sparse_layers):
            raise ValueError(
                f"sparse layers {moe.sparse_layers} out of range for {self.num_hidden_layers} layers"
            )

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head (1 for multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_layer_indices(self) -> tuple[int, ...]:
        if not self.layer_types:
            return tuple(range(self.num_hidden_layers))
        return tuple(index for index, kind in enumerate(self.layer_types) if kind == ATTENTION_LAYER)

    @property
    def conv_layer_indices(self) -> tuple[int, ...]:
        return tuple(index for index, kind in enumerate(self.layer_types) if kind == CONV_LAYER)

    @property
    def num_kv_layers(self) -> int:
        """Layers with K/V pages: every layer of a Llama, the attention layers of a hybrid."""
        return len(self.attention_layer_indices)

    def attention_kind(self, layer_index: int) -> AttentionKind:
        """The attention of layer `layer_index` (full unless the family's traits say otherwise)."""
        layer_attention = self.traits.layer_attention
        return layer_attention[layer_index] if layer_attention else FULL_ATTENTION

    @property
    def kv_layer_windows(self) -> tuple[int | None, ...]:
        """Per KV-pool layer, its sliding window (None: full attention): what a cache that frees
        out-of-window blocks needs to know."""
        return tuple(self.attention_kind(index).sliding_window for index in self.attention_layer_indices)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct windows of the model's sliding layers, ascending (empty: all full)."""
        return tuple(sorted({window for window in self.kv_layer_windows if window is not None}))

    @property
    def is_hybrid(self) -> bool:
        """Some layer carries a recurrent state, so prefix reuse also needs a state snapshot."""
        return bool(self.conv_layer_indices)

    @property
    def state_width(self) -> int:
        """Past inputs one convolution layer keeps: its window minus the current token."""
        return self.conv_kernel_size - 1 if self.is_hybrid else 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parses a Hugging Face config.json through its family's module (by `model_type`)."""
        # The family modules build ModelConfig themselves, so the registry is imported here.
        from engine.models.families import config_from_dict

        return config_from_dict(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as file:
            try:
                raw = json.load(file)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{path}: not valid JSON ({error})") from None
        return cls.from_dict(raw)


def lfm2_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """transformers' Lfm2Config: norm_eps, layer_types (or full_attn_idxs), conv_L_cache,
    conv_bias, and the feed-forward width adjusted as Lfm2MLP does."""
    num_layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is None:
        attention = raw.get("full_attn_idxs")
        attention = set(range(num_layers) if attention is None else attention)
        layer_types = [ATTENTION_LAYER if index in attention else CONV_LAYER for index in range(num_layers)]
    intermediate_size = int(raw.get("block_ff_dim", raw["intermediate_size"]))
    if raw.get("block_auto_adjust_ff_dim", True):
        intermediate_size = int(2 * intermediate_size / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple_of = int(raw.get("block_multiple_of", 256))
            intermediate_size = int(multiplier * intermediate_size)
            intermediate_size = multiple_of * ((intermediate_size + multiple_of - 1) // multiple_of)
    num_attention_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    max_position_embeddings = int(raw.get("max_position_embeddings", 128_000))
    rope_theta, rope_scaling = parse_rope({"rope_theta": 1000000.0, **raw}, max_position_embeddings)
    if rope_scaling is not None:
        raise ValueError("lfm2 with rope scaling is not supported")
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_attention_heads),
        head_dim=hidden_size // num_attention_heads,
        rms_norm_eps=float(raw.get("norm_eps", 1e-5)),
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_embedding", raw.get("tie_word_embeddings", True))),
        bos_token_id=first_token_id(raw.get("bos_token_id", 1)),
        eos_token_id=first_token_id(raw.get("eos_token_id", 2)),
        model_type="lfm2",
        layer_types=tuple(layer_types),
        conv_kernel_size=int(raw.get("conv_L_cache", 3)),
        conv_bias=bool(raw.get("conv_bias", False)),
    )


def refuse_unless(raw: dict[str, Any], name: str, allowed: tuple[object, ...]) -> None:
    if name in raw and raw[name] not in allowed:
        raise ValueError(f"{name}={raw[name]!r} is not supported (supported: {allowed})")


def parse_rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either config format.

    transformers 5 writes `rope_parameters` {rope_type, rope_theta, ...}; older files write
    `rope_theta` at top level and an optional `rope_scaling` {type | rope_type, factor, ...}.
    """
    theta = float(raw.get("rope_theta", 10000.0))
    scaling = None
    for name in ("rope_parameters", "rope_scaling"):
        rope = raw.get(name)
        if rope is None:
            continue
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{name}.rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{name}.partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
        theta = float(rope.get("rope_theta", theta))
        if rope_type == "llama3":
            missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key not in rope]
            if missing:
                raise ValueError(f"{name} of rope_type llama3 lacks {missing}")
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", max_position_embeddings)
                ),
            )
    return theta, scaling


def first_token_id(value: int | list[int] | None) -> int | None:
    # Llama 3 lists several end tokens; the engine stops on one, the first (what HF reports first).
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)
