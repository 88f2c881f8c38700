"""The Qwen3-MoE sparse feed-forward: a router picks K of X experts per token, each a SwiGLU MLP.

Dimensions: N tokens in the batch, E hidden size, I expert intermediate size, X experts,
K experts per token (`num_experts_per_tok`), S = N * K (token, expert) assignments.

Parameter names are those transformers' `save_pretrained` writes for a Qwen3-MoE layer under
`model.layers.{i}.mlp.`: `gate.weight` [X, E] (the router) and, per expert j,
`experts.{j}.gate_proj.weight` [I, E], `experts.{j}.up_proj.weight` [I, E] and
`experts.{j}.down_proj.weight` [E, I]. (transformers 5 keeps the experts fused in memory,
`experts.gate_up_proj` [X, 2I, E] and `experts.down_proj` [X, E, I], and splits them on save;
the file is what a checkpoint holds, so the layer's `mlp.` slice loads here by name.)

How it computes, and why (docs/model.md, "The mixture-of-experts feed-forward"):
- The router follows transformers' order of operations: logits in the working dtype, softmax in
  float32 (float64 models too), top-K, renormalised over the K when `norm_topk_prob`, cast back.
- The experts run for all the batch's tokens at once: the S assignments are sorted by expert,
  each expert that has any gets one SwiGLU over its rows, and the results go back to their
  (token, rank) slot. No Python loop runs over tokens, only over the experts that were picked.
- Batch invariance: every row of an expert's matmul goes through the module's linear layers,
  which make_batch_invariant turns into RowChunkedLinear like every other nn.Linear, so a row's
  bits do not depend on the other rows its expert got. An expert's rows are neither the batch's
  tokens nor its sequences, so the pass's RowLayout does not describe them: they run with none
  (the default grouping, invariant too). The K weighted expert outputs of a token are summed in
  rank order (its top-1 first), never in an order set by which experts the batch touched.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.batch_invariant import row_layout

ACTIVATION_WIDTH = 64  # elements: a multiple of every CPU elementwise loop's step (2 vectors of <= 32)
ELEMENTWISE_GRAIN = 32768  # at::internal::GRAIN_SIZE: elementwise calls this large are split among threads


def invariant_silu(gate: torch.Tensor) -> torch.Tensor:
    """silu of gate [n, I] -> [n, I], each row's bits independent of n.

    PyTorch's CPU elementwise loop runs whole steps of vectors, then a scalar tail, and splits a
    call of ELEMENTWISE_GRAIN or more elements among threads at offsets set by the element count.
    silu's vector exp (Sleef) and scalar exp (libm) round differently, so a row's bits depend on
    where it lands: measured here (AVX-512, float32), a 24-wide row alone gave 2 of 24 values
    other bits than inside a [2, 24] call. Rows padded to ACTIVATION_WIDTH columns and calls kept
    under the grain put every element on the vector path. The experts' own I (768, 1408, 1536)
    are multiples of 64, so real models pay no copy; GPUs compute each element alike anyway."""
    num_rows, width = gate.shape
    if gate.device.type != "cpu":
        return nn.functional.silu(gate)
    padded_width = -(-width // ACTIVATION_WIDTH) * ACTIVATION_WIDTH
    if padded_width != width:
        gate = nn.functional.pad(gate, (0, padded_width - width))  # [n, I rounded up]
    rows_per_call = max(1, (ELEMENTWISE_GRAIN - 1) // padded_width)  # one row past the grain: split alike
    if num_rows <= rows_per_call:
        return nn.functional.silu(gate)[:, :width]
    calls = [
        nn.functional.silu(gate[first : first + rows_per_call]) for first in range(0, num_rows, rows_per_call)
    ]
    return torch.cat(calls)[:, :width]


class Expert(nn.Module):
    """One SwiGLU expert: [n, E] -> [n, I] -> [n, E]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The product is one rounding in every code path; silu is not (see invariant_silu).
        return self.down_proj(invariant_silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's `mlp` of a sparse layer: hidden [N, E] -> [N, E]."""

    def __init__(
        self,
        *,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("moe_intermediate_size", moe_intermediate_size),
            ("num_experts", num_experts),
            ("num_experts_per_tok", num_experts_per_tok),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_experts_per_tok > num_experts:
            raise ValueError(
                f"num_experts_per_tok ({num_experts_per_tok}) exceeds num_experts ({num_experts})"
            )
        if not isinstance(norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(hidden_size, moe_intermediate_size) for _ in range(num_experts))

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, E] -> (weights [N, K] in hidden's dtype, expert_ids [N, K]), best first.

        The same operations in the same order as transformers' Qwen3MoeTopKRouter, so that a
        float64 model gets its weights bit for bit (they pass through float32 there too)."""
        logits = self.gate(hidden)  # [N, X]
        probabilities = nn.functional.softmax(logits, dim=-1, dtype=torch.float32)  # [N, X]
        weights, expert_ids = torch.topk(probabilities, self.num_experts_per_tok, dim=-1)  # [N, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), expert_ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"SparseMoeBlock takes [tokens, {self.hidden_size}], got {tuple(hidden.shape)}")
        num_tokens, top_k = hidden.shape[0], self.num_experts_per_tok
        weights, expert_ids = self.route(hidden)  # [N, K]
        # Slot s = token * K + rank. A stable sort groups the slots by expert (tokens ascending
        # within each); an expert's slots are then one contiguous range of `order`:
        #   order: [ expert 0's slots | expert 1's slots | ... ]   (an unpicked expert's is empty)
        order = torch.argsort(expert_ids.reshape(-1), stable=True)  # [S]
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).tolist()  # [X]
        sorted_rows = hidden[order // top_k]  # [S, E]
        sorted_outputs = torch.empty_like(sorted_rows)  # [S, E]
        with row_layout(None):  # an expert's rows are not the pass's rows (see the module docstring)
            start = 0
            for expert_id, count in enumerate(counts):
                if count:
                    end = start + count
                    sorted_outputs[start:end] = self.experts[expert_id](sorted_rows[start:end])
                    start = end
        slot_outputs = torch.empty_like(sorted_outputs)  # [S, E]
        slot_outputs[order] = sorted_outputs
        weighted = slot_outputs.view(num_tokens, top_k, self.hidden_size) * weights[:, :, None]  # [N, K, E]
        # Rank order, one add at a time: a token's sum never depends on the batch's experts.
        output = weighted[:, 0]
        for rank in range(1, top_k):
            output = output + weighted[:, rank]
        return output  # [N, E]
