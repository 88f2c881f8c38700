"""Qwen3-MoE (`model_type: qwen3_moe`): Qwen3's attention (q/k norm per head) with a sparse
mixture-of-experts feed-forward (engine/models/moe.py) on the layers transformers makes sparse:
layer i is sparse when i is not in `mlp_only_layers`, `num_experts` > 0 and
(i + 1) % `decoder_sparse_step` == 0; the others keep a dense MLP of `intermediate_size`.
Every layer slides over `sliding_window` when `use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.llama import activation, decoder_config
from engine.models.traits import SILU, AttentionKind, FamilyTraits, MoeTraits


def num_experts(raw: dict[str, Any]) -> int:
    """transformers 5 writes `num_local_experts` (its attribute map's name for num_experts)."""
    return int(raw.get("num_experts", raw.get("num_local_experts", 128)))


def sparse_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    num_layers = int(raw["num_hidden_layers"])
    experts = num_experts(raw)
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = {int(index) for index in raw.get("mlp_only_layers") or ()}
    return tuple(
        index for index in range(num_layers) if index not in dense and experts > 0 and (index + 1) % step == 0
    )


def qwen3_moe_from_dict(raw: dict[str, Any]) -> ModelConfig:
    bias = bool(raw.get("attention_bias", False))
    num_layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layers = sparse_layers(raw)
    moe = None
    if layers:
        moe = MoeTraits(
            num_experts=num_experts(raw),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=layers,
        )
    traits = FamilyTraits(
        family="qwen3_moe",
        qkv_bias=bias,
        output_bias=bias,
        qk_norm=True,
        layer_attention=() if window is None else (AttentionKind(sliding_window=int(window)),) * num_layers,
        moe=moe,
    )
    return decoder_config(raw, traits, activation=activation(raw, "hidden_act", {"silu": SILU}))
