"""Plain records the engine hands to its callers (workers, the command line, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-prob of its token (engine/logprobs.py computes them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the position's best (token id, log-prob), best first


@dataclass(frozen=True)
class Beam:
    # Generated tokens only, ending with eos (or the token completing a stop string) when it stopped.
    token_ids: list[int]
    cumulative_logprob: float
    score: float  # what transformers reports as sequences_scores
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[list[int]]  # per live beam: tokens decided since the previous output
    finished: bool
    beams: list[Beam] = field(default_factory=list)  # best first, filled when finished
    stats: dict[str, float | int] = field(default_factory=dict)
    error: str | None = None  # set when the engine had to drop the request
    # Per live beam, which live beam of the previous output it continues (beams reorder, so a
    # stream rebuilds beam i as previous[parent_indices[i]] + new_token_ids[i]).
    parent_indices: list[int] = field(default_factory=list)
    # Context side (LLMEngine.add_prefill): set on the finished output of a prefill-only request.
    prefill: PrefillResult | None = None
    # Finished output of a request with prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A one-sequence request with logprobs, not finished: the records of new_token_ids[0].
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    block_ids: list[int]  # ceil(P / T) blocks holding the prompt's KV, pinned until released
    prompt_len: int
    candidate_ids: list[int]  # top next tokens of the last prompt position, best first
    candidate_logprobs: list[float]  # float32 log_softmax of the logits (the decoders'), same order
    reused_tokens: int
    # The same candidates' log-probs in the model's precision (engine/logprobs.py report_dtype):
    # what a scored request reports for its first token. Empty (a float32 model): candidate_logprobs.
    candidate_model_logprobs: list[float] = field(default_factory=list)
    # Hybrid models: the recurrent state after the whole prompt, raw bytes in the model's dtype
    # (engine/state_pool.py layout); empty for a model without recurrent layers.
    recurrent_state: bytes = b""
    num_tokens_before_hybrid_pruning: int = 0  # what the pages alone supported (>= reused_tokens)
    # Asked with prompt_logprobs: positions 1 .. P-1 (position 0 has no log-prob).
    prompt_logprobs: list[TokenLogprob] | None = None
    # Window-aware KV groups (engine/kv_groups.py): per group the pinned pages, HOLE (-1) where a
    # sliding group released the block (out of the window at the prompt's end); () for one group.
    group_page_ids: tuple[tuple[int, ...], ...] = ()
    # The pages to offer, as pages of the engine's transfer region (engine/region_pages.py): the
    # held blocks of every group in canonical order; block_ids for a one-group pool.
    region_page_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PromptReservation:
    request_id: str
    block_ids: list[int]  # ceil(P / T) blocks for the prompt, owned by the request
    num_cached_blocks: int  # block_ids[num_cached_blocks:] must be filled by a pull
    # Per KV group its pages, HOLE (-1) where nothing is pulled (engine/kv_group_tables.pages_to_pull);
    # () for one group.
    group_page_ids: tuple[tuple[int, ...], ...] = ()
    # The pull, in region pages (engine/region_pages.py): positions in the holder's
    # region_page_ids to read, and this engine's region pages to write, one for one.
    source_positions: list[int] = field(default_factory=list)
    region_page_ids: list[int] = field(default_factory=list)
    num_source_pages: int = 0  # how many region pages the holder offers for this prompt

    @property
    def missing_block_ids(self) -> list[int]:
        return self.block_ids[self.num_cached_blocks :]


@dataclass(frozen=True)
class KVRegion:
    address: int  # data_ptr of page 0
    page_bytes: int  # one block across all layers, K and V
    num_pages: int
    device: str


@dataclass(frozen=True)
class EngineCounters:
    """A snapshot of the engine's pool, queue and lifetime counters, for a server's metrics.

    Gauges (`num_*`) are values now; the others only grow over the engine's life.
    """

    num_blocks_total: int
    num_blocks_in_use: int  # referenced by a request, a pinned prompt or a reservation
    num_blocks_cached: int  # unreferenced, published in the prefix tree: evictable
    num_waiting_requests: int  # queued in the scheduler, not yet admitted
    num_running_requests: int  # in the continuous batch
    prompt_tokens: int  # prompt tokens looked up in the prefix tree
    reused_tokens: int  # of those, found there (their KV was not computed or pulled again)
    beam_tail_copies: int  # partial last blocks copied for a forked beam
    partial_reuse_copies: int  # partly reused blocks copied before being written
    hybrid_pruned_tokens: int = 0  # prompt tokens the pages held but no state snapshot reached
    # prompt tokens the full-attention layers held but a sliding layer's window did not
    window_pruned_tokens: int = 0
    # Per attention kind of the KV groups (engine/kv_groups.py), named "full" or "window<W>": the
    # shared pool's size (the same for every kind) and the blocks in use, summed over its groups.
    group_names: tuple[str, ...] = ()
    group_blocks_total: tuple[int, ...] = ()
    group_blocks_in_use: tuple[int, ...] = ()
