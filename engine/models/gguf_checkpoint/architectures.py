"""Per GGUF architecture: the Hugging Face config dict its metadata stands for, and its tensor names.

Each architecture is a table, not a branch in the loader: `config` turns the metadata into the
fields transformers' `config.json` of that family holds (the keys llama.cpp's converter wrote them
from, read back), `layer_tensors` renames `blk.{i}.{gguf}` to `layers.{i}.{hf}`. What llama.cpp
fixes in code rather than in the file is restated here with the reason (Gemma 3's layer pattern
and sliding rope base, Qwen3-MoE's normalised top-k).

Values llama.cpp's converter changed are undone in `tensors.py`: the rotary row interleave (llama
only: llama.cpp's `LlamaModel` permutes q/k for its rope kernel; Qwen2/Qwen3/Qwen3-MoE/Gemma 3/Phi-3
use the NEOX rope there and are written as Hugging Face has them), Gemma's norms stored as 1 + w,
Qwen3-MoE's experts stacked into one 3-D tensor per projection.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.models.gguf_checkpoint.metadata import Metadata

# llama.cpp's Gemma 3 graph (llama-model.cpp): every 6th layer is global, the others slide, and the
# sliding layers rotate with base 10000; older converters write neither to the file (newer ones may
# write attention.sliding_window_pattern and rope.freq_base_swa, read when present). transformers' Gemma3TextConfig
# defaults agree (sliding_window_pattern 6, rope_local_base_freq 10000).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's queries by hidden / heads, the others by head_dim

COMMON_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Stacked [experts, out, in] in the file; split into transformers' saved per-expert names.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
TOP_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    config: Callable[[Metadata, frozenset[str]], dict[str, Any]]  # (metadata, tensor names) -> HF dict
    layer_tensors: Mapping[str, str]
    is_rotary_interleaved: bool = False  # q/k rows permuted by llama.cpp (llama only)
    norm_shift: float = 0.0  # stored norm weight = HF weight + norm_shift (Gemma: 1)
    expert_tensors: Mapping[str, str] = field(default_factory=dict)


def _common(meta: Metadata, tensor_names: frozenset[str], model_type: str) -> dict[str, Any]:
    """The fields every decoder family shares, as transformers' config.json names them."""
    num_heads, hidden_size = int(meta.arch("attention.head_count")), int(meta.arch("embedding_length"))
    head_dim = int(meta.arch("attention.key_length", hidden_size // num_heads))
    if int(meta.arch("attention.value_length", head_dim)) != head_dim:
        raise meta.error(
            f"metadata {meta.architecture}.attention.value_length != key_length is not supported"
        )
    num_kv_heads = meta.arch("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise meta.error(f"metadata {meta.architecture}.attention.head_count_kv per layer is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = meta.arch("vocab_size", len(tokens) if tokens else None)
    if "rope_freqs.weight" in tensor_names or any(name.startswith("rope_factors") for name in tensor_names):
        raise meta.error("tensor rope_freqs / rope_factors (rope frequency factors) is not supported")
    return {
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": int(meta.arch("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": decimal(meta.arch("attention.layer_norm_rms_epsilon")),
        "rope_theta": decimal(meta.arch("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta),
        "max_position_embeddings": int(meta.arch("context_length")),
        # llama.cpp writes no output.weight when the head is the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def decimal(value: float) -> float:
    """The shortest decimal a float32 field holds: the converter wrote 1e-6 as 9.99999997e-07."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: Metadata) -> dict[str, Any] | None:
    kind = meta.arch("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": decimal(meta.arch("rope.scaling.factor"))}
    raise meta.error(
        f"metadata {meta.architecture}.rope.scaling.type={kind!r} is not supported (none, linear)"
    )


def _full_rotary(meta: Metadata, config: dict[str, Any]) -> None:
    rotary = int(meta.arch("rope.dimension_count", config["head_dim"]))
    if rotary != config["head_dim"]:
        raise meta.error(
            f"metadata {meta.architecture}.rope.dimension_count={rotary} != head dim {config['head_dim']} "
            "(partial rotary) is not supported"
        )


def _has_bias(tensor_names: frozenset[str]) -> bool:
    return any(name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for name in tensor_names)


def _llama(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    config = _common(meta, tensor_names, "llama")
    _full_rotary(meta, config)
    return {**config, "hidden_act": "silu", "attention_bias": _has_bias(tensor_names)}


def _qwen2(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    config = _common(meta, tensor_names, "qwen2")
    _full_rotary(meta, config)
    if config.pop("head_dim") != config["hidden_size"] // config["num_attention_heads"]:
        raise meta.error("metadata qwen2.attention.key_length != hidden / heads is not supported")
    # Qwen2 always has q/k/v biases (no config field); llama.cpp keeps no sliding window for it.
    return {**config, "hidden_act": "silu", "use_sliding_window": False}


def _qwen3(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    config = _common(meta, tensor_names, "qwen3")
    _full_rotary(meta, config)
    return {
        **config,
        "hidden_act": "silu",
        "attention_bias": _has_bias(tensor_names),
        "use_sliding_window": False,
    }


def _qwen3_moe(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    config = {**_qwen3(meta, tensor_names), "model_type": "qwen3_moe"}
    # llama.cpp's qwen3moe has experts in every layer (its tensor list has no dense ffn_gate there),
    # so a file never holds mlp_only_layers; a dense tensor is refused as unexpected at load.
    return {
        **config,
        "num_experts": int(meta.arch("expert_count")),
        "num_experts_per_tok": int(meta.arch("expert_used_count")),
        "moe_intermediate_size": int(meta.arch("expert_feed_forward_length")),
        # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights
        "norm_topk_prob": bool(meta.arch("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gemma3(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    config = _common(meta, tensor_names, "gemma3_text")
    _full_rotary(meta, config)
    num_layers = config["num_hidden_layers"]
    pattern = meta.arch("attention.sliding_window_pattern", [])  # per layer, True = sliding
    if not pattern:
        pattern = [(index + 1) % GEMMA3_SLIDING_PATTERN != 0 for index in range(num_layers)]
    if len(pattern) != num_layers:
        raise meta.error(f"metadata gemma3.attention.sliding_window_pattern has {len(pattern)} entries")
    scalar = (
        config["hidden_size"] // config["num_attention_heads"]
        if num_layers == GEMMA3_27B_LAYERS
        else config["head_dim"]
    )
    return {
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "sliding_window": int(meta.arch("attention.sliding_window")),
        "layer_types": ["sliding_attention" if sliding else "full_attention" for sliding in pattern],
        "rope_local_base_freq": decimal(meta.arch("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": _optional_float(meta.arch("final_logit_softcapping", 0.0)),
        "attn_logit_softcapping": _optional_float(meta.arch("attn_logit_softcapping", 0.0)),
    }


def _phi3(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    config = _common(meta, tensor_names, "phi3")
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise meta.error("metadata phi3.attention.key_length != hidden / heads is not supported")
    del config["head_dim"]  # Phi3Config has none: hidden / heads
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(meta.arch("rope.dimension_count", head_dim))
    # llama.cpp writes the long-rope attention factor always; 1 means no long-rope scaling
    if float(meta.arch("rope.scaling.attn_factor", 1.0)) != 1.0:
        raise meta.error("metadata phi3.rope.scaling.attn_factor != 1 (longrope) is not supported")
    window = int(meta.arch("attention.sliding_window", 0))
    if rotary != head_dim:  # Phi-4-mini's 0.75; Phi-3's config.json has no such field
        config["partial_rotary_factor"] = rotary / head_dim
    return {
        **config,
        "hidden_act": "silu",
        "sliding_window": window or None,
        "original_max_position_embeddings": int(
            meta.arch("rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
    }


def _optional_float(value: float) -> float | None:
    return decimal(value) if value else None


ARCHITECTURES = {
    architecture.name: architecture
    for architecture in (
        Architecture("llama", _llama, COMMON_LAYER_TENSORS, is_rotary_interleaved=True),
        Architecture("qwen2", _qwen2, COMMON_LAYER_TENSORS),
        Architecture("qwen3", _qwen3, {**COMMON_LAYER_TENSORS, **QK_NORM_TENSORS}),
        Architecture(
            "qwen3moe",
            _qwen3_moe,
            {**COMMON_LAYER_TENSORS, **QK_NORM_TENSORS, "ffn_gate_inp": "mlp.gate"},
            expert_tensors=EXPERT_TENSORS,
        ),
        Architecture(
            "gemma3",
            _gemma3,
            {
                **COMMON_LAYER_TENSORS,
                **QK_NORM_TENSORS,
                # Gemma's four norms: llama.cpp's ffn_norm is the pre-feed-forward one here
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            norm_shift=1.0,
        ),
        Architecture(
            "phi3",
            _phi3,
            {
                "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm",
                "attn_qkv": "self_attn.qkv_proj",
                "attn_output": "self_attn.o_proj",
                "ffn_up": "mlp.gate_up_proj",  # fused [gate; up], as Phi-3 keeps it
                "ffn_down": "mlp.down_proj",
            },
        ),
    )
}
