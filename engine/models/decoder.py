"""A Llama decoder over the paged KV pool.

Dimensions: N new tokens in the batch, B sequences, E hidden size, I intermediate size,
H query heads, Hkv key/value heads, D head dim, V vocabulary.

Module and parameter names follow Hugging Face's LlamaForCausalLM without the leading `model.`,
so a checkpoint loads by name. Numerics follow it too where it leaves the working dtype
(RMSNorm and the rotary tables in float32), so a float64 run reproduces its logits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.kv_pool import KVPool
from engine.models.config import Llama3RopeScaling, ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 whatever the dtype, as the reference does; float64 included.
        input_dtype = hidden.dtype
        hidden32 = hidden.to(torch.float32)
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        normalised = hidden32 * torch.rsqrt(variance + self.eps)
        return self.weight * normalised.to(input_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        """[D/2] in float32, with the reference's operations in its order (llama3 included)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.scaling is None:
            return inv_freq
        factor = self.scaling.factor
        low, high = self.scaling.low_freq_factor, self.scaling.high_freq_factor
        old_context_len = self.scaling.original_max_position_embeddings
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept,
        # and the band between is interpolated.
        wavelen = 2 * math.pi / inv_freq
        stretched = torch.where(wavelen > old_context_len / low, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * stretched / factor + smooth * stretched
        is_medium = ~(wavelen < old_context_len / high) * ~(wavelen > old_context_len / low)
        return torch.where(is_medium, smoothed, stretched)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, D] in `dtype`.

        Recomputed per call in float32 rather than kept as a buffer, which `model.to(bfloat16)`
        would round; float32 throughout is what the reference does.
        """
        inv_freq = self.inverse_frequencies(positions.device)  # [D/2]
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    half = tensor.shape[-1] // 2
    return torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)


def apply_rotary(tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """tensor [N, heads, D], cos and sin [N, D]."""
    return tensor * cos[:, None, :] + rotate_half(tensor) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hidden, kv_width = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, hidden, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [N, E] -> [N, E]; writes the new tokens' K/V into kv_layer [blocks, 2, T, Hkv, D]."""
        num_tokens = hidden.shape[0]
        query = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)  # [N, H, D]
        key = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        write_kv(kv_layer, key, value, metadata)
        output = paged_attention(query, kv_layer, metadata, self.scale)  # [N, H, D]
        return self.o_proj(output.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """SwiGLU: [N, E] -> [N, I] -> [N, E]."""
        return self.down_proj(nn.functional.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_layer, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit weight skips nn.Embedding's random init: every loader overwrites it, and on the
        # meta device that init's first call costs over a second of lazy imports.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [N] -> logits [B, V] of each sequence's last new token.

        Logits are float64 for a float64 model and float32 otherwise (bfloat16 is widened).
        """
        hidden = self.hidden_states(input_ids, positions, kv_pool, metadata)  # [N, E]
        # RMSNorm and lm_head are per token, so only the rows whose logits are wanted go through.
        return self.compute_logits(hidden[metadata.logits_indices])  # [B, V]

    @torch.no_grad()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [N] -> the last layer's output [N, E], before the final norm."""
        if kv_pool.dtype != self.dtype:
            raise ValueError(f"kv_pool dtype {kv_pool.dtype} differs from the model's {self.dtype}")
        hidden = self.embed_tokens(input_ids)  # [N, E]
        cos, sin = self.rotary(positions, hidden.dtype)  # [N, D]
        for layer_index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, kv_pool.layer_view(layer_index), metadata)
        return hidden

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, E] (hidden_states' rows) -> logits [R, V], float64 or float32."""
        logits = self.lm_head(self.norm(hidden))  # [R, V]
        return logits if logits.dtype == torch.float64 else logits.to(torch.float32)
