"""Runs one forward pass over a batch of sequences and returns next-token log-probs.

`prepare_batch` packs the Python-side batch (block ids, cached length, new tokens) into tensors
once; the rest is tensor code. Any mix of prompt chunks and single decode tokens.

Log-probs are `log_softmax` of the logits cast to float32, as transformers' `generate` computes
them whatever the model's dtype: beam search arithmetic is then identical to the reference.

Dimensions: B sequences, N new tokens in the batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, prepare_attention
from engine.kv_pool import KVPool
from engine.model import LlamaModel


@dataclass(frozen=True)
class SequenceInput:
    block_ids: Sequence[int]  # the sequence's table, covering num_cached_tokens + len(token_ids)
    num_cached_tokens: int  # tokens already in the pool (positions 0 .. num_cached_tokens - 1)
    token_ids: Sequence[int]  # new tokens at positions num_cached_tokens ...


@dataclass(frozen=True)
class PreparedBatch:
    input_ids: torch.Tensor  # [N]
    metadata: AttentionMetadata


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_pool: KVPool) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.device

    def prepare_batch(self, seqs: Sequence[SequenceInput]) -> PreparedBatch:
        specs = [(seq.block_ids, seq.num_cached_tokens, len(seq.token_ids)) for seq in seqs]
        metadata = prepare_attention(specs, self.kv_pool.tokens_per_block, self.device)
        token_ids = [token_id for seq in seqs for token_id in seq.token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [N]
        return PreparedBatch(input_ids, metadata)

    def compute_logprobs(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:
        """Writes the new tokens' K/V into the pool; returns [B, V] float32 log-probs on the CPU."""
        batch = self.prepare_batch(seqs)
        logits = self.model(batch.input_ids, batch.metadata.positions, self.kv_pool, batch.metadata)  # [B, V]
        return torch.log_softmax(logits.to(torch.float32), dim=-1).cpu()
