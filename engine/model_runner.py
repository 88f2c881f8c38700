"""Runs one forward pass over a batch of sequences and returns next-token log-probs.

`prepare_batch` packs the Python-side batch (block ids, cached length, new tokens, and for a
hybrid model state slots and snapshot requests) into tensors once; the rest is tensor code.
Any mix of prompt chunks and single decode tokens.

Log-probs are `log_softmax` of the logits cast to float32, as transformers' `generate` computes
them whatever the model's dtype: beam search arithmetic is then identical to the reference. The
same rows in the model's precision (float64 for a float64 model) come beside them for what is
reported to the client (engine/logprobs.py); for a float32 model they are the same tensor.

Scoring rows (a prompt's every position, engine/logprobs.py) go through the final norm and the LM
head SCORE_ROW_CHUNK at a time, outside the batch's row layout: [P, V] never exists for a long
prompt, and each row's numbers still depend on nothing but the row.

Dimensions: B sequences, N new tokens in the batch, V vocabulary, C scoring rows of one chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.attention import AttentionMetadata, prepare_attention
from engine.batch_invariant import make_row_layout, row_layout
from engine.kv_cache import HOLE
from engine.kv_pool import GroupedKVPool, KVPool
from engine.logprobs import report_logprobs, score_rows
from engine.models.lfm2 import Lfm2Model
from engine.models.loader import Model
from engine.models.short_conv import RecurrentMetadata, prepare_recurrent
from engine.state_pool import StatePool
from engine.types import TokenLogprob

SCORE_ROW_CHUNK = 128  # scoring rows per LM-head call: [C, V] float32 is 25 MB for a 49k vocabulary


@dataclass(frozen=True)
class SequenceInput:
    block_ids: Sequence[int]  # the sequence's table, covering num_cached_tokens + len(token_ids)
    num_cached_tokens: int  # tokens already in the pool (positions 0 .. num_cached_tokens - 1)
    token_ids: Sequence[int]  # new tokens at positions num_cached_tokens ...
    # Hybrid models only: the slot holding the state after num_cached_tokens tokens (advanced in
    # place), and (num_tokens, block_id) snapshots to store on the way.
    state_slot_id: int | None = None
    snapshots: Sequence[tuple[int, int]] = field(default_factory=tuple)
    # A decode step (one generated token) rather than prompt tokens: in batch-invariant mode the
    # role picks the attention kernel's shape (engine/invariant_attention.py).
    is_decode: bool = False
    # Decode steps only: the request's beam count W (its W sequences sit together in the batch).
    num_beams: int = 1
    # KV groups (engine/kv_groups.py): every group's table, group 0's first (== block_ids); empty
    # for a one-group cache. A sliding group's tables may lead with HOLEs.
    group_block_ids: Sequence[Sequence[int]] = ()
    # Scoring a prompt: the tokens that follow its first len(score_target_ids) new tokens; those
    # rows' log-probs (the target's and the best score_num_top) come back with the pass.
    score_target_ids: Sequence[int] = ()
    score_num_top: int = 0


@dataclass(frozen=True)
class ForwardOutput:
    logprobs: torch.Tensor  # [B, V] float32, each sequence's last new token: what decoders use
    model_logprobs: torch.Tensor  # [B, V] the same rows in report_dtype: what is reported
    scores: list[list[TokenLogprob]]  # [B] lists, one record per score target (empty: none asked)


@dataclass(frozen=True)
class PreparedBatch:
    input_ids: torch.Tensor  # [N]
    metadata: AttentionMetadata
    recurrent: RecurrentMetadata | None


def without_holes(block_ids: Sequence[int]) -> Sequence[int]:
    """A released block (HOLE) read as page 0: any valid page does, the window mask hides it."""
    if HOLE not in block_ids:
        return block_ids
    return [0 if block_id == HOLE else block_id for block_id in block_ids]


def beam_group_sizes(seqs: Sequence[SequenceInput]) -> list[int]:
    """Per sequence: 0 for prompt tokens, else the W of its request (whose W beams are consecutive)."""
    return [seq.num_beams if seq.is_decode else 0 for seq in seqs]


class ModelRunner:
    def __init__(
        self,
        model: Model,
        kv_pool: KVPool | GroupedKVPool,
        state_pool: StatePool | None = None,
        batch_invariant: bool = False,
        group_windows: Sequence[int | None] = (None,),
        native_attention: bool = False,
    ) -> None:
        """batch_invariant: a sequence's log-probs do not depend on the rest of the batch; the
        model's linear layers must be RowChunkedLinear too (make_batch_invariant). group_windows:
        each KV group's window (engine/kv_groups.py; one group: the pool is one layout).
        native_attention: with batch_invariant, every token's attention (prompt and decode) runs
        the compiled kernel (engine/native_kernels.py; the caller has loaded it)."""
        if isinstance(model, Lfm2Model) != (state_pool is not None):
            raise ValueError("a state pool goes with a hybrid model, and only with one")
        self.batch_invariant = batch_invariant
        self.model = model
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = kv_pool.device
        self.group_windows = tuple(group_windows)
        self.native_attention = native_attention and batch_invariant

    def prepare_batch(self, seqs: Sequence[SequenceInput]) -> PreparedBatch:
        is_decode = [seq.is_decode for seq in seqs] if self.batch_invariant else None
        model_windows = self.model.config.sliding_windows

        def group_metadata(group: int) -> AttentionMetadata:
            window = self.group_windows[group]
            specs = [
                (without_holes(seq.group_block_ids[group] if seq.group_block_ids else seq.block_ids),
                 seq.num_cached_tokens, len(seq.token_ids))
                for seq in seqs
            ]  # fmt: skip
            windows = model_windows if window is None else (window,)
            return prepare_attention(
                specs, self.kv_pool.tokens_per_block, self.device, is_decode, beam_group_sizes(seqs), windows,
                self.native_attention,
            )  # fmt: skip

        metadata = group_metadata(0)
        if len(self.group_windows) > 1:
            by_group = tuple(group_metadata(group) for group in range(1, len(self.group_windows)))
            metadata = replace(metadata, by_group=by_group)
        token_ids = [token_id for seq in seqs for token_id in seq.token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [N]
        recurrent = None
        if self.state_pool is not None:
            slot_ids = [seq.state_slot_id for seq in seqs]
            if any(slot_id is None for slot_id in slot_ids):
                raise ValueError("every sequence of a hybrid model needs a state slot")
            recurrent = prepare_recurrent(
                [slot_id for slot_id in slot_ids if slot_id is not None],
                [seq.snapshots for seq in seqs],
                [seq.num_cached_tokens for seq in seqs],
                metadata,
                self.model.config.conv_kernel_size,
            )
        return PreparedBatch(input_ids, metadata, recurrent)

    def compute_logprobs(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:
        """Writes the new tokens' K/V (and states) into the pools; returns [B, V] float32 log-probs
        on the CPU."""
        return self.forward(seqs).logprobs

    def forward(self, seqs: Sequence[SequenceInput]) -> ForwardOutput:
        """compute_logprobs, plus the scoring rows each sequence asked for."""
        batch = self.prepare_batch(seqs)
        positions = batch.metadata.positions
        layout: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.batch_invariant:
            layout = row_layout(
                make_row_layout([len(seq.token_ids) for seq in seqs], beam_group_sizes(seqs), self.device)
            )
        with layout:
            if isinstance(self.model, Lfm2Model):
                hidden = self.model.hidden_states(
                    batch.input_ids, positions, self.kv_pool, batch.metadata, self.state_pool, batch.recurrent
                )  # [N, E]
            else:
                hidden = self.model.hidden_states(batch.input_ids, positions, self.kv_pool, batch.metadata)
            logits = self.model.compute_logits(hidden[batch.metadata.logits_indices])  # [B, V]
        logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1).cpu()  # [B, V]
        model_logprobs = report_logprobs(logits, logprobs).cpu()  # [B, V]; float32: logprobs itself
        scores = self._score(hidden, seqs, batch.metadata.query_start_loc.tolist())
        return ForwardOutput(logprobs, model_logprobs, scores)

    def _score(
        self, hidden: torch.Tensor, seqs: Sequence[SequenceInput], starts: list[int]
    ) -> list[list[TokenLogprob]]:
        """hidden: [N, E]; sequence b's rows start at starts[b]."""
        scores: list[list[TokenLogprob]] = []
        for seq, start in zip(seqs, starts, strict=False):
            records: list[TokenLogprob] = []
            targets = list(seq.score_target_ids)
            for first in range(0, len(targets), SCORE_ROW_CHUNK):
                chunk = targets[first : first + SCORE_ROW_CHUNK]
                rows = hidden[start + first : start + first + len(chunk)]  # [C, E]
                records.extend(score_rows(self.model.compute_logits(rows).cpu(), chunk, seq.score_num_top))
            scores.append(records)
        return scores
