"""How a model family differs from the common decoder (engine/models/decoder.py, a Llama).

A family module (llama.py, qwen2.py, qwen3.py, qwen3_moe.py, mistral.py, gemma3.py, phi3.py)
parses its Hugging Face config.json into a ModelConfig whose `traits` declare these differences;
the decoder builds its modules from the traits once, so the forward pass holds no family checks.

The attention of a layer is its AttentionKind: full, or a sliding window of W positions (a query
at position p sees the keys at positions p - W + 1 .. p, transformers' `kv_idx > q_idx - W`),
and its rotary base. The window belongs to the layer, so the KV cache can later keep only what a
layer's window needs (ModelConfig.kv_layer_windows lists it per KV layer).
"""

from __future__ import annotations

from dataclasses import dataclass

SILU = "silu"
GELU_TANH = "gelu_tanh"
ACTIVATIONS = (SILU, GELU_TANH)


@dataclass(frozen=True)
class AttentionKind:
    """One layer's attention: `sliding_window` None is full causal attention; `rope_theta` None
    uses the config's rope_theta and rope scaling (a separate base, e.g. Gemma 3's local layers,
    is unscaled)."""

    sliding_window: int | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")


FULL_ATTENTION = AttentionKind()


@dataclass(frozen=True)
class MoeTraits:
    """A mixture-of-experts feed-forward (Qwen3-MoE) on the layers in `sparse_layers`; the other
    layers keep the dense MLP of width `intermediate_size`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")


@dataclass(frozen=True)
class FamilyTraits:
    """The defaults are Llama's. Parameter names stay Hugging Face's (without `model.`)."""

    family: str = "llama"
    qkv_bias: bool = False  # q_proj, k_proj, v_proj carry a bias (Qwen2; attention_bias elsewhere)
    output_bias: bool = False  # o_proj carries a bias (attention_bias in Qwen3, Gemma 3)
    qk_norm: bool = False  # RMSNorm over each head's query and key before rotary (q_norm, k_norm)
    fused_qkv: bool = False  # one qkv_proj [q | k | v] (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj [gate | up] (Phi-3)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), all in float32 (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden), rounded to the model dtype (Gemma)
    # Gemma's four norms a layer: post_attention_layernorm on the attention's output, then
    # pre_feedforward_layernorm and post_feedforward_layernorm around the MLP. Without them
    # post_attention_layernorm is the MLP's input norm (Llama's naming).
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (else head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    activation: str = SILU
    layer_attention: tuple[AttentionKind, ...] = ()  # per layer; () means every layer full
    moe: MoeTraits | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported ({ACTIVATIONS})")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be > 0, got {self.final_logit_softcapping}")


LLAMA_TRAITS = FamilyTraits()
