"""Per-token log-probs for scoring: a prompt's positions and each returned sequence's tokens.

What is reported is the model's own distribution: `log_softmax` of the logits, before any
temperature, top-k or top-p (vLLM's default `raw_logprobs`), so greedy, sampling and every beam
report the same kind of number. Every reported number is in the model's precision
(`report_dtype`: float64 for a float64 model, float32 otherwise), prompt positions and generated
tokens alike. The decoders keep their own float32 rows (what transformers' `generate` decides
with), so which tokens are picked, and the beams' cumulative scores, do not change with scoring:
a generated token's record takes the ids from the decoder's row and the values from the model's.

`score_rows` turns a chunk of a prompt's rows into records without ever holding more than the
chunk's [C, V]. `LogprobTrie` follows a request's beams: every step records each running beam's
best tokens, so a finished beam (which may have left the running set one step before it ended)
can be walked back from the root token by token.

Dimensions: C rows of one chunk, V vocabulary, W running beams, M tokens kept per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.beam_search import BeamStep
from engine.types import TokenLogprob


def report_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reported log-probs are computed in for a model of `dtype`: never below float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def report_logprobs(logits: torch.Tensor, decoder_logprobs: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] in the model's dtype; decoder_logprobs: [B, V] float32, log_softmax of the
    same logits cast to float32 (what the decoders use). -> [B, V] log_softmax in report_dtype
    (the decoders' own tensor when that is float32)."""
    if report_dtype(logits.dtype) == decoder_logprobs.dtype:
        return decoder_logprobs
    return torch.log_softmax(logits.to(report_dtype(logits.dtype)), dim=-1)


def top_entries(row: torch.Tensor, num_top: int) -> tuple[tuple[int, float], ...]:
    """row: [V] -> its best num_top (token id, log-prob), best first (ties: lowest id first)."""
    if num_top <= 0:
        return ()
    values, indices = torch.topk(row, k=min(num_top, row.shape[-1]))  # [M]
    return tuple(zip(indices.tolist(), values.tolist(), strict=True))


def score_rows(logits: torch.Tensor, target_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits: [C, V] of C consecutive positions; target_ids: the C tokens that follow them.

    log_softmax in report_dtype, as transformers' `log_softmax(logits, -1)` of the same pass."""
    logprobs = torch.log_softmax(logits.to(report_dtype(logits.dtype)), dim=-1)  # [C, V]
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)  # [C]
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()  # [C]
    records = []
    if num_top > 0:
        values, indices = torch.topk(logprobs, k=min(num_top, logprobs.shape[-1]), dim=-1)  # [C, M]
        for token_id, logprob, ids, lps in zip(
            target_ids, chosen, indices.tolist(), values.tolist(), strict=True
        ):
            records.append(TokenLogprob(token_id, logprob, tuple(zip(ids, lps, strict=True))))
    else:
        records = [
            TokenLogprob(token_id, logprob) for token_id, logprob in zip(target_ids, chosen, strict=True)
        ]
    return records


@dataclass
class LogprobTrie:
    """The tokens a request's beams may end up holding, with their log-probs.

    Node 0 is the empty continuation; node n's children are the tokens its row ranked in its top
    M = max(2W, num_top) (beam search draws its 2W candidates from there) plus any token a decoder
    picked outside them (sampling). `running` holds running beam i's node.

    Ranks come from the decoders' float32 rows (so every candidate a decoder can pick is an edge,
    whatever the precisions' rounding does to near-ties); values come from the model's rows
    (report_logprobs): a record is the model-precision log-prob of the token the decoder took."""

    num_top: int
    top: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    edges: dict[tuple[int, int], tuple[int, float]] = field(
        default_factory=dict
    )  # (node, token) -> (child, lp)
    running: list[int] = field(default_factory=lambda: [0])
    num_nodes: int = 1
    streamed: int = 0  # one sequence: the node its streamed records reached (take_streamed)

    def record_candidates(self, candidate_ids: list[int], candidate_logprobs: list[float]) -> None:
        """The first step: the prompt's best tokens (best first, by the decoder's row) are the
        root's children; candidate_logprobs are their model-precision log-probs."""
        self.top[0] = tuple(
            zip(candidate_ids[: self.num_top], candidate_logprobs[: self.num_top], strict=True)
        )
        for token_id, logprob in zip(candidate_ids, candidate_logprobs, strict=True):
            self._add_edge(0, token_id, logprob)

    def record_rows(self, rows: torch.Tensor, model_rows: torch.Tensor, num_kept: int) -> None:
        """rows: [W, V] the decoder's float32 log-probs of the running beams, in running order;
        model_rows: [W, V] the same rows in the model's precision."""
        indices = torch.topk(rows, k=min(max(num_kept, self.num_top), rows.shape[-1]), dim=-1)[1]  # [W, M]
        values = model_rows.gather(1, indices)  # [W, M]
        for node, ids, lps in zip(self.running, indices.tolist(), values.tolist(), strict=True):
            self.top[node] = tuple(zip(ids[: self.num_top], lps[: self.num_top], strict=True))
            for token_id, logprob in zip(ids, lps, strict=True):
                self._add_edge(node, token_id, logprob)

    def follow(self, rows: torch.Tensor, model_rows: torch.Tensor, num_kept: int, step: BeamStep) -> None:
        """A decoder stepped from `rows` ([W, V] float32, running order; the first step: the last
        prompt position's [1, V]): record each row's best max(num_kept, num_top), then advance."""
        self.record_rows(rows, model_rows, num_kept)
        self.advance(step.parent_indices, step.token_ids, model_rows)

    def advance(
        self, parent_indices: list[int], token_ids: list[int], model_rows: torch.Tensor | None
    ) -> None:
        """The decoder continued parent_indices[i] with token_ids[i]; model_rows ([W, V] in the
        model's precision, None on a pulled request's first step) give a picked token that no row
        ranked."""
        running = []
        for parent, token_id in zip(parent_indices, token_ids, strict=True):
            node = self.running[parent]
            if (node, token_id) not in self.edges:
                logprob = float(model_rows[parent, token_id]) if model_rows is not None else math.nan
                self._add_edge(node, token_id, logprob)
            running.append(self.edges[(node, token_id)][0])
        self.running = running

    def walk(self, token_ids: list[int]) -> list[TokenLogprob]:
        """The records of a sequence of generated tokens, from the root (NaN where a token was
        never a candidate, which only exact ties at the rank boundary can cause)."""
        return self._walk_from(0, token_ids)[0]

    def take_streamed(self, new_token_ids: list[list[int]]) -> list[TokenLogprob]:
        """new_token_ids: per running beam, its tokens decided since the previous call. One
        sequence (no beams to reorder): their records, continuing the ones that call returned;
        several beams: none (their records come with the finished beams)."""
        if len(new_token_ids) != 1:
            return []
        records, self.streamed = self._walk_from(self.streamed, new_token_ids[0])
        return records

    def _walk_from(self, node: int, token_ids: list[int]) -> tuple[list[TokenLogprob], int]:
        records = []
        for token_id in token_ids:
            top = self.top.get(node, ())
            child = self.edges.get((node, token_id))
            if child is None:
                records.append(TokenLogprob(token_id, math.nan, top))
                node = -1
                continue
            records.append(TokenLogprob(token_id, child[1], top))
            node = child[0]
        return records, node

    def check_integrity(self) -> None:
        """Node ids are 0 .. num_nodes - 1, each made by exactly one edge; running beams sit on nodes."""
        children = sorted(child for child, _ in self.edges.values())
        if children != list(range(1, self.num_nodes)):
            raise AssertionError(f"trie nodes {children[:8]}... are not 1 .. {self.num_nodes - 1}")
        if any(not 0 <= node < self.num_nodes for node in self.running):
            raise AssertionError(f"running beams on unknown nodes {self.running}")
        if not -1 <= self.streamed < self.num_nodes:
            raise AssertionError(f"streamed records end on unknown node {self.streamed}")
        if any(len(top) > self.num_top for top in self.top.values()):
            raise AssertionError(f"a position keeps more than {self.num_top} alternatives")

    def _add_edge(self, node: int, token_id: int, logprob: float) -> None:
        if (node, token_id) not in self.edges:
            self.edges[(node, token_id)] = (self.num_nodes, logprob)
            self.num_nodes += 1
