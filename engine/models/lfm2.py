"""LFM2, a hybrid decoder: short-convolution layers mixed with attention layers.

Dimensions: N new tokens in the batch, B sequences, E hidden size, I intermediate size,
H query heads, Hkv key/value heads, D head dim, K convolution kernel, V vocabulary.

Names and numerics follow transformers' Lfm2ForCausalLM (without the leading `model.`):
- an attention layer is Llama's with RMSNorm on each head's query and key before rotary, and
  `out_proj`; its K/V go to the paged pool (attention layer j uses pool layer j);
- a convolution layer projects to (B, C, x), convolves B*x causally over time with a depthwise
  kernel of K taps, gates by C and projects back; its state is the last K-1 values of B*x
  (convolution layer c uses index c of the state pool);
- every layer: operator_norm -> mixer -> residual, ffn_norm -> SwiGLU (w1, w3, w2) -> residual;
  the final norm is `embedding_norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.kv_pool import GroupedKVPool, KVPool
from engine.models.config import ATTENTION_LAYER, ModelConfig
from engine.models.decoder import RotaryEmbedding, apply_rotary_table, rotary_table
from engine.models.norms import RMSNorm
from engine.models.q8_embedding import embedding_dtype
from engine.models.short_conv import RecurrentMetadata, short_conv
from engine.state_pool import StatePool


class Lfm2Attention(nn.Module):
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
        self.out_proj = nn.Linear(config.num_attention_heads * config.head_dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_layernorm = RMSNorm(config.head_dim, config.rms_norm_eps)

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
        query = self.q_layernorm(self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim))
        key = self.k_layernorm(self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim))
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        query, key = apply_rotary_table(query, cos, sin), apply_rotary_table(key, cos, sin)
        write_kv(kv_layer, key, value, metadata)
        output = paged_attention(query, kv_layer, metadata, self.scale)  # [N, H, D]
        return self.out_proj(output.reshape(num_tokens, self.num_heads * self.head_dim))


class Lfm2ShortConv(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, kernel = config.hidden_size, config.conv_kernel_size
        # Same parameter shapes as nn.Conv1d(E, E, K, groups=E): weight [E, 1, K].
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=config.conv_bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=config.conv_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.conv_bias)

    def forward(
        self, hidden: torch.Tensor, slots: torch.Tensor, snapshots: torch.Tensor, metadata: RecurrentMetadata
    ) -> torch.Tensor:
        """hidden [N, E] -> [N, E]; slots [S, K-1, E] and snapshots [blocks, K-1, E] of this layer."""
        gate_in, gate_out, values = self.in_proj(hidden).chunk(3, dim=-1)  # 3 x [N, E]
        weight = self.conv.weight.squeeze(1)  # [E, K]
        convolved = short_conv(gate_in * values, weight, self.conv.bias, slots, snapshots, metadata)
        return self.out_proj(gate_out * convolved)


class Lfm2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(hidden)) * self.w3(hidden))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, is_attention: bool) -> None:
        super().__init__()
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = Lfm2Attention(config)
        else:
            self.conv = Lfm2ShortConv(config)
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor | None,
        metadata: AttentionMetadata,
        state: tuple[torch.Tensor, torch.Tensor, RecurrentMetadata] | None,
    ) -> torch.Tensor:
        """hidden [N, E] -> [N, E]; an attention layer gets its kv_layer, a convolution layer its
        (slots, snapshots, recurrent metadata)."""
        normed = self.operator_norm(hidden)
        if self.is_attention:
            assert kv_layer is not None
            mixed = self.self_attn(normed, cos, sin, kv_layer, metadata)
        else:
            assert state is not None
            mixed = self.conv(normed, *state)
        hidden = hidden + mixed
        return hidden + self.feed_forward(self.ffn_norm(hidden))


class Lfm2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(config, kind == ATTENTION_LAYER) for kind in config.layer_types
        )
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return embedding_dtype(self.embed_tokens)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool | GroupedKVPool,
        metadata: AttentionMetadata,
        state_pool: StatePool | None = None,
        recurrent: RecurrentMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [N] -> logits [B, V] of each sequence's last new token; the
        sequences' states advance in their slots and the requested snapshots are stored."""
        hidden = self.hidden_states(input_ids, positions, kv_pool, metadata, state_pool, recurrent)  # [N, E]
        return self.compute_logits(hidden[metadata.logits_indices])  # [B, V]

    @torch.no_grad()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool | GroupedKVPool,
        metadata: AttentionMetadata,
        state_pool: StatePool | None = None,
        recurrent: RecurrentMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [N] -> the last layer's output [N, E], before the final norm."""
        if state_pool is None or recurrent is None:
            raise ValueError("a hybrid model needs a state pool and recurrent metadata")
        hidden = self.embed_tokens(input_ids)  # [N, E]
        cos, sin = rotary_table(*self.rotary(positions, hidden.dtype))  # [N, 1, D] each, sin signed
        attention_index, conv_index = 0, 0
        for layer_type, layer in zip(self.config.layer_types, self.layers, strict=True):
            if layer_type == ATTENTION_LAYER:
                kv_layer = kv_pool.layer_view(attention_index)
                hidden = layer(hidden, cos, sin, kv_layer, metadata, None)
                attention_index += 1
            else:
                state = (state_pool.slots[:, conv_index], state_pool.snapshots[:, conv_index], recurrent)
                hidden = layer(hidden, cos, sin, None, metadata, state)
                conv_index += 1
        return hidden

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, E] (hidden_states' rows) -> logits [R, V], float64 or float32."""
        logits = self.lm_head(self.embedding_norm(hidden))  # [R, V]
        return logits if logits.dtype == torch.float64 else logits.to(torch.float32)
