"""Gemma 3 text (`model_type: gemma3_text`, or `gemma3` whose `text_config` is one).

What it adds to the common decoder (transformers' Gemma3ForCausalLM):
- `layer_types`: sliding_attention layers see the last `sliding_window` positions and rotate with
  their own base (`rope_parameters.sliding_attention.rope_theta`, older files
  `rope_local_base_freq`, default 10000); full_attention layers use the global base (default 1e6)
  and its rope scaling. Without layer_types, every `sliding_window_pattern`-th layer (default 6)
  is full;
- RMSNorm scaling by (1 + weight), computed in float32; embeddings times sqrt(hidden) rounded to the
  model dtype; four norms per layer; q/k RMSNorm per head; attention scale
  `query_pre_attn_scalar` ** -0.5; gelu (tanh) activation; `final_logit_softcapping`.
Refused with the field named: attn_logit_softcapping, use_bidirectional_attention, a rope type
other than default / llama3 (Gemma 3 4B+ use linear scaling).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig, parse_rope, refuse_unless
from engine.models.llama import activation, decoder_config
from engine.models.traits import GELU_TANH, AttentionKind, FamilyTraits

DEFAULT_GLOBAL_THETA = 1_000_000.0
DEFAULT_LOCAL_THETA = 10_000.0


def gemma3_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """`gemma3` (the multimodal wrapper) is read through its text_config."""
    if raw.get("model_type") == "gemma3":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("model_type gemma3 needs a text_config")
        raw = {**text, "model_type": "gemma3_text"}
    return gemma3_text_from_dict(raw)


def gemma3_text_from_dict(raw: dict[str, Any]) -> ModelConfig:
    refuse_unless(raw, "use_bidirectional_attention", (False, None))
    num_layers = int(raw.get("num_hidden_layers", 26))
    layer_types = raw.get("layer_types")
    if layer_types is None:
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = [
            "sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(num_layers)
        ]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (sliding_attention, full_attention)")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    max_position_embeddings = int(raw.get("max_position_embeddings", 131_072))
    global_rope, local_theta = _rope(raw, max_position_embeddings)
    window = raw.get("sliding_window", 4096)
    if window is None and "sliding_attention" in layer_types:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
    local = AttentionKind(sliding_window=None if window is None else int(window), rope_theta=local_theta)
    head_dim = int(raw.get("head_dim", 256))
    softcap = raw.get("final_logit_softcapping")
    traits = FamilyTraits(
        family="gemma3",
        qkv_bias=bool(raw.get("attention_bias", False)),
        output_bias=bool(raw.get("attention_bias", False)),
        qk_norm=True,
        norm_offset=True,
        scale_embeddings=True,
        sandwich_norms=True,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        layer_attention=tuple(
            local if kind == "sliding_attention" else AttentionKind() for kind in layer_types
        ),
    )
    defaults = {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }
    return decoder_config(
        {**defaults, **raw},
        traits,
        activation=activation(raw, "hidden_activation", {"gelu_pytorch_tanh": GELU_TANH}),
        rope=global_rope,
        default_tie_word_embeddings=True,
    )


def _rope(raw: dict[str, Any], max_position_embeddings: int) -> tuple[tuple[float, Any], float]:
    """((global theta, global scaling), local theta) from transformers 5's per-layer-type
    `rope_parameters` or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict) and ("full_attention" in parameters or "sliding_attention" in parameters):
        full = parameters.get("full_attention") or {}
        sliding = parameters.get("sliding_attention") or {}
        global_rope = parse_rope(
            {"rope_theta": DEFAULT_GLOBAL_THETA, "rope_parameters": full}, max_position_embeddings
        )
        local_theta, local_scaling = parse_rope(
            {"rope_theta": DEFAULT_LOCAL_THETA, "rope_parameters": sliding}, max_position_embeddings
        )
        if local_scaling is not None:
            raise ValueError(
                "rope_parameters.sliding_attention: rope scaling is not supported on sliding layers"
            )
        return global_rope, local_theta
    global_rope = parse_rope({"rope_theta": DEFAULT_GLOBAL_THETA, **raw}, max_position_embeddings)
    return global_rope, float(raw.get("rope_local_base_freq", DEFAULT_LOCAL_THETA))
