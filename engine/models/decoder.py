"""The common decoder over the paged KV pool: a Llama, shaped by the family's traits.

Dimensions: N new tokens in the batch, B sequences, E hidden size, I intermediate size,
H query heads, Hkv key/value heads, D head dim, V vocabulary.

Module and parameter names follow Hugging Face's *ForCausalLM without the leading `model.`,
so a checkpoint loads by name. Numerics follow it too where it leaves the working dtype
(RMSNorm and the rotary tables in float32), so a float64 run reproduces its logits.

How a family differs (engine/models/traits.py) is read once, when the modules are built: which
projections exist and carry biases, which norms, which activation, each layer's attention kind
(window, rotary base) and feed-forward (dense or experts). The forward pass runs whatever was
built; absent norms are identities.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.kv_pool import GroupedKVPool, KVPool
from engine.models.config import Llama3RopeScaling, ModelConfig
from engine.models.moe import SparseMoeBlock
from engine.models.norms import NATIVE_NORM_DTYPES, RMSNorm, make_norm
from engine.models.q8_embedding import embedding_dtype
from engine.models.traits import GELU_TANH, AttentionKind


def use_native_activation(model: nn.Module, kernel: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """Every SiLU-gated MLP of `model` runs `kernel` (engine/native_kernels.silu_mul_kernel) for
    its split, activation and product from now on, where its gate and up are one projection."""
    for module in model.modules():
        if isinstance(module, MLP) and module.activation is nn.functional.silu:
            module.native_silu_mul = kernel


def use_native_rotary(model: nn.Module, kernel: Callable[..., torch.Tensor]) -> None:
    """Every Attention of `model` whose projection is fused runs `kernel`
    (engine/native_kernels.rotary_kernel) for its rotary and K/V write from now on."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.native_rotary_write = kernel


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == GELU_TANH:
        return lambda tensor: nn.functional.gelu(tensor, approximate="tanh")
    return nn.functional.silu


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), transformers' order of operations; no cap leaves them as they are."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


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


def rotary_table(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] -> cos and the signed sin [N, 1, D] that apply_rotary_table reads: sin with
    its first half negated, so transformers' rotate_half negation moves onto the table, computed
    once a pass instead of once per layer and tensor ((-x) s and x (-s) are the same bits)."""
    half = sin.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def apply_rotary_table(tensor: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x cos + rotate_half(x) sin` bits in four ops (tests/unit/test_decode_step_ops.py):
    tensor [N, heads, D], rotary_table's cos and signed_sin [N, 1, D]. roll by D/2 is rotate_half
    without its negation: (x2, x1)."""
    return tensor * cos + tensor.roll(tensor.shape[-1] // 2, dims=-1) * signed_sin


def adjacent_columns(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """first [N, A], second [N, B] -> the view [N, A + B] of both where second's columns follow
    first's in the same storage (the split of one fused projection's output), else None."""
    if (
        first.dim() != 2
        or first.stride() != second.stride()
        or first.stride(-1) != 1
        or first.shape[0] != second.shape[0]
        or first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
        or second.storage_offset() != first.storage_offset() + first.shape[1]
    ):
        return None
    return first.as_strided((first.shape[0], first.shape[1] + second.shape[1]), first.stride())


class Attention(nn.Module):
    # torch.ops.beamsplit.rotary_write where the engine loaded it (use_native_rotary): the rotary of
    # a fused projection's q and k and the K/V write in one call, the same bits as the torch ops.
    native_rotary_write: Callable[..., torch.Tensor] | None = None

    def __init__(self, config: ModelConfig, kind: AttentionKind) -> None:
        super().__init__()
        traits = config.traits
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = kind.sliding_window
        scalar = traits.query_pre_attn_scalar
        self.scale = (config.head_dim if scalar is None else scalar) ** -0.5
        hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
        self.split = (q_width, kv_width, kv_width)
        if traits.fused_qkv:
            self.qkv_proj = nn.Linear(hidden, q_width + 2 * kv_width, bias=traits.qkv_bias)
            self.project: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = self._project_fused
        else:
            self.q_proj = nn.Linear(hidden, q_width, bias=traits.qkv_bias)
            self.k_proj = nn.Linear(hidden, kv_width, bias=traits.qkv_bias)
            self.v_proj = nn.Linear(hidden, kv_width, bias=traits.qkv_bias)
            self.project = self._project_apart
        self.o_proj = nn.Linear(q_width, hidden, bias=traits.output_bias)
        identity = nn.Identity()
        if traits.qk_norm:
            self.q_norm = make_norm(config, config.head_dim)
            self.k_norm = make_norm(config, config.head_dim)
        # Plain references (a tuple is not registered), so no module is listed twice.
        self.head_norms = (self.q_norm, self.k_norm) if traits.qk_norm else (identity, identity)
        self.has_head_norms = traits.qk_norm

    def _project_apart(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def _project_fused(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.qkv_proj(hidden).split(self.split, dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden [N, E] -> [N, E]; writes the new tokens' K/V into kv_layer [blocks, 2, T, Hkv, D].
        cos and sin: rotary_table's [N, 1, D] (sin signed)."""
        num_tokens = hidden.shape[0]
        native = self.native_rotary_write
        if native is not None and self._takes_native_rotary(hidden):
            # The fused projection's rows [N, (H + 2 Hkv) D] in, the rotated queries out; the keys
            # (rotated) and values are written into the pool by the same call.
            query = native(
                self.qkv_proj(hidden).contiguous(), self.num_heads, cos.reshape(num_tokens, -1),
                sin.reshape(num_tokens, -1), kv_layer, metadata.slot_blocks, metadata.slot_offsets,
            )  # fmt: skip
        else:
            query = self._rotate_and_write(hidden, cos, sin, kv_layer, metadata)
        output = paged_attention(query, kv_layer, metadata, self.scale, self.sliding_window)  # [N, H, D]
        return self.o_proj(output.reshape(num_tokens, self.num_heads * self.head_dim))

    def _rotate_and_write(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The torch ops of forward's first half: projections, head norms, rotary, the K/V write;
        returns the rotated queries [N, H, D]."""
        num_tokens = hidden.shape[0]
        query, key, value = self.project(hidden)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        query_key = None if self.has_head_norms else adjacent_columns(query, key)
        if query_key is not None:
            # One fused projection's q and k side by side: rotated in one pass (element-wise, the
            # same bits as apart), then split again.
            num_heads = self.num_heads + self.num_kv_heads
            rotated = apply_rotary_table(query_key.view(num_tokens, num_heads, self.head_dim), cos, sin)
            query, key = rotated.split((self.num_heads, self.num_kv_heads), dim=1)  # [N, H | Hkv, D]
        else:
            q_norm, k_norm = self.head_norms
            query = q_norm(query.view(num_tokens, self.num_heads, self.head_dim))  # [N, H, D]
            key = k_norm(key.view(num_tokens, self.num_kv_heads, self.head_dim))  # [N, Hkv, D]
            query, key = apply_rotary_table(query, cos, sin), apply_rotary_table(key, cos, sin)
        write_kv(kv_layer, key, value, metadata)
        return query

    def _takes_native_rotary(self, hidden: torch.Tensor) -> bool:
        """The compiled rotary and K/V write can take this pass: q, k and v one projection (fused at
        load or by the family), no per-head norms, float32 or bfloat16, whole 32-lane halves."""
        return (
            "qkv_proj" in self._modules
            and not self.has_head_norms
            and hidden.dtype in NATIVE_NORM_DTYPES
            and self.head_dim % 32 == 0
        )


class MLP(nn.Module):
    # torch.ops.beamsplit.silu_mul where the engine loaded it (use_native_activation): silu(gate) *
    # up from the fused projection's rows in one call, torch's bits (engine/native/kernels.cpp).
    native_silu_mul: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.width = width
        if config.traits.fused_gate_up:
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=False)
            self.gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = self._gate_up_fused
        else:
            self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.gate_up = self._gate_up_apart
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.activation = activation_function(config.traits.activation)

    def _gate_up_apart(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.gate_proj(hidden), self.up_proj(hidden)

    def _gate_up_fused(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.gate_up_proj(hidden).split(self.width, dim=-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gated: [N, E] -> [N, I] -> [N, E]."""
        native = self.native_silu_mul
        if native is not None and "gate_up_proj" in self._modules and hidden.dtype in NATIVE_NORM_DTYPES:
            return self.down_proj(native(self.gate_up_proj(hidden), self.width))
        gate, up = self.gate_up(hidden)
        return self.down_proj(self.activation(gate) * up)


def make_feed_forward(config: ModelConfig, layer_index: int) -> nn.Module:
    """The dense MLP, or on a family's sparse layers the mixture of experts."""
    moe = config.traits.moe
    if moe is not None and layer_index in moe.sparse_layers:
        return SparseMoeBlock(
            hidden_size=config.hidden_size,
            moe_intermediate_size=moe.moe_intermediate_size,
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.num_experts_per_tok,
            norm_topk_prob=moe.norm_topk_prob,
        )
    return MLP(config)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, config.attention_kind(layer_index))
        self.mlp = make_feed_forward(config, layer_index)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        identity = nn.Identity()
        # Gemma's sandwich: post_attention_layernorm normalises the attention output, two more norms
        # wrap the MLP. Otherwise post_attention_layernorm is the MLP's input norm (Llama's name).
        # (attention output, MLP input, MLP output) norms, as plain references.
        self.norms: tuple[nn.Module, nn.Module, nn.Module]
        if config.traits.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)
            self.norms = (
                self.post_attention_layernorm,
                self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm,
            )
        else:
            self.norms = (identity, self.post_attention_layernorm, identity)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attention_out_norm, mlp_in_norm, mlp_out_norm = self.norms
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_layer, metadata)
        hidden = hidden + attention_out_norm(attended)
        return hidden + mlp_out_norm(self.mlp(mlp_in_norm(hidden)))

    def residual_forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with its input and output as (residual, delta), their sum the hidden state, so
        that each residual add is taken with the norm after it (RMSNorm.add_and_norm): the same
        bits as forward. Plain norms only (not Gemma's sandwich); delta None for the first layer."""
        input_norm, post_norm = (
            cast(RMSNorm, self.input_layernorm),
            cast(RMSNorm, self.post_attention_layernorm),
        )
        if delta is None:
            normed = input_norm(residual)
        else:
            residual, normed = input_norm.add_and_norm(residual, delta)
        attended = self.self_attn(normed, cos, sin, kv_layer, metadata)
        residual, normed = post_norm.add_and_norm(residual, attended)
        return residual, self.mlp(normed)


class LlamaModel(nn.Module):
    """The common decoder (named after the family it was first; every non-hybrid family runs it)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit weight skips nn.Embedding's random init: every loader overwrites it, and on the
        # meta device that init's first call costs over a second of lazy imports.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # One rotary table per distinct base; layer i reads table layer_rotary[i]. A separate base
        # (Gemma 3's sliding layers) is unscaled.
        bases = [config.attention_kind(index).rope_theta for index in range(config.num_hidden_layers)]
        distinct = sorted({base for base in bases if base is not None})
        self.rotaries = [self.rotary] + [RotaryEmbedding(config.head_dim, base) for base in distinct]
        self.layer_rotary = [0 if base is None else 1 + distinct.index(base) for base in bases]
        self.embedding_scale = math.sqrt(config.hidden_size) if config.traits.scale_embeddings else None
        self.final_logit_softcapping = config.traits.final_logit_softcapping
        # Plain RMSNorms around each block: the layers pass (residual, delta) pairs (residual_forward)
        self.pairs_residuals = not (config.traits.sandwich_norms or config.traits.norm_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return embedding_dtype(self.embed_tokens)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> [N, E]; Gemma's scale is rounded to the model dtype first, as transformers does."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is None:
            return hidden
        return hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype, device=hidden.device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool | GroupedKVPool,
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
        kv_pool: KVPool | GroupedKVPool,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [N] -> the last layer's output [N, E], before the final norm."""
        if kv_pool.dtype != self.dtype:
            raise ValueError(f"kv_pool dtype {kv_pool.dtype} differs from the model's {self.dtype}")
        hidden = self.embed(input_ids)  # [N, E]
        # Each cos and signed sin [N, 1, D], once a pass for all layers
        tables = [rotary_table(*rotary(positions, hidden.dtype)) for rotary in self.rotaries]
        delta: torch.Tensor | None = None
        for layer_index, layer in enumerate(self.layers):
            cos, sin = tables[self.layer_rotary[layer_index]]
            # Each KV group has its own block tables (engine/kv_groups.py).
            group_metadata = metadata.for_group(kv_pool.group_of_layer(layer_index))
            kv_layer = kv_pool.layer_view(layer_index)
            if self.pairs_residuals:
                decoder_layer = cast(DecoderLayer, layer)
                hidden, delta = decoder_layer.residual_forward(
                    hidden, delta, cos, sin, kv_layer, group_metadata
                )
            else:
                hidden = layer(hidden, cos, sin, kv_layer, group_metadata)
        return hidden if delta is None else hidden + delta

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, E] (hidden_states' rows) -> logits [R, V], float64 or float32 (soft-capped
        where the family caps them)."""
        logits = softcap(self.lm_head(self.norm(hidden)), self.final_logit_softcapping)  # [R, V]
        return logits if logits.dtype == torch.float64 else logits.to(torch.float32)
