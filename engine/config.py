"""Frozen, validated configuration of the engine's parts.

Each config checks itself on construction and is never mutated; a value learnt at run time makes
a new config with `dataclasses.replace`. Errors name the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
SUPPORTED_DTYPES = ("float32", "float64", "bfloat16")
MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (OpenAI's bound)


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_block: int = 32
    num_blocks: int = 2048
    enable_partial_reuse: bool = False
    enable_partial_commit: bool = False
    # When set, the engine lowers num_blocks to what fits in this many bytes once the model (and so
    # the page size) is known: a real model's 2048 pages can be gigabytes.
    max_pool_bytes: int | None = None
    # The servers' default: the pool is exactly what max_pool_bytes holds (num_blocks is ignored),
    # so a budget, not a block count, decides the pool's memory whatever the model's page size.
    is_sized_by_memory: bool = False
    # KV groups per attention kind sharing one pool, and a sliding-window group releases the
    # blocks out of its window (engine/kv_groups.py, docs/cache.md). Off: one group, every block
    # of every layer kept (the layout before KV groups).
    sliding_window_kv: bool = True

    def __post_init__(self) -> None:
        if self.tokens_per_block not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"tokens_per_block must be one of {SUPPORTED_BLOCK_SIZES}, got {self.tokens_per_block}"
            )
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_pool_bytes is not None and self.max_pool_bytes < 1:
            raise ValueError(f"max_pool_bytes must be >= 1, got {self.max_pool_bytes}")
        if self.is_sized_by_memory and self.max_pool_bytes is None:
            raise ValueError("is_sized_by_memory needs max_pool_bytes")

    def fitted_to(self, page_bytes: int) -> CacheConfig:
        """This config with num_blocks lowered to fit max_pool_bytes (at least one block), or set to
        what it holds when sized by memory."""
        if self.max_pool_bytes is None:
            return self
        num_fitting = max(1, self.max_pool_bytes // page_bytes)
        return replace(
            self, num_blocks=num_fitting if self.is_sized_by_memory else min(self.num_blocks, num_fitting)
        )

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_seqs: int = 64
    seed: int = 0
    # A request's tokens and scores do not depend on what else is in the batch (fixed-shape
    # kernels, engine/batch_invariant.py and engine/invariant_attention.py). On by default: its
    # attention is also the varlen one (the plain kernel pads every sequence to the batch's longest query, ruinous when decode steps
    # share a batch with prompt chunks); bench invariance measured it at 0.96-1.07x of the plain
    # kernels, 0.59x for a 2048-token prefill, 0.55x for a beam-4 request decoding and 0.74x for
    # 8 of them (stop 19).
    batch_invariant: bool = True
    # On a CPU: decode tokens' attention (with batch_invariant) and float32/bfloat16 RMSNorm run one
    # compiled call each (engine/native_kernels.py, built once per machine) instead of ~80 and 6
    # torch ops; off, or where no C++ compiler builds them, the torch forms run.
    native_kernels: bool = True
    # Tokens one forward pass may feed: one per decoding beam first, then prompt chunks in order
    # (chunked prefill, docs/engine.md). At least max_num_seqs: the beams admitted next to a prompt
    # still being prefilled always leave it some of the budget.
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_batched_tokens}"
            )

    @property
    def supports_beam_search(self) -> bool:
        # A published non-full block would be shared by beams that then write into it.
        return not self.cache.enable_partial_commit


@dataclass(frozen=True)
class SamplingParams:
    beam_width: int = 1
    max_new_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False (transformers' default) or "never"
    eos_token_id: int | None = None
    ignore_eos: bool = False  # decode to max_new_tokens even through the model's eos
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # A sequence ends at the token whose text completes one of these (engine/stop_strings.py);
    # with beam search a candidate that completes one ends as one ending on eos does.
    stop_strings: tuple[str, ...] = ()
    # Scoring (engine/logprobs.py): None off; k >= 0 reports each returned token's log-prob (and
    # the best k at its position); prompt_logprobs does the same for every prompt position after
    # the first, which makes the request skip the prefix cache (its positions need logits).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    MAX_BEAM_WIDTH = 64
    MAX_ABS_LENGTH_PENALTY = 16.0
    MAX_STOP_STRINGS = 4
    MAX_STOP_STRING_CHARS = 128  # each step decodes a tail this long per running sequence

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= self.MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {self.MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not abs(self.length_penalty) <= self.MAX_ABS_LENGTH_PENALTY:  # also refuses NaN
            # length ** penalty must stay a float: 131072 ** 16 is 2**272, far from overflow.
            raise ValueError(
                f"length_penalty must be in [-{self.MAX_ABS_LENGTH_PENALTY:g}, {self.MAX_ABS_LENGTH_PENALTY:g}], "
                f"got {self.length_penalty}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.eos_token_id is not None and self.eos_token_id < 0:
            raise ValueError(f"eos_token_id must be >= 0, got {self.eos_token_id}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > 0 and self.beam_width > 1:
            raise ValueError("temperature > 0 (sampling) needs beam_width 1")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.stop_strings, tuple):
            raise ValueError(
                f"stop_strings must be a tuple of strings, got {type(self.stop_strings).__name__}"
            )
        if len(self.stop_strings) > self.MAX_STOP_STRINGS:
            raise ValueError(
                f"stop_strings takes at most {self.MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}"
            )
        for index, string in enumerate(self.stop_strings):
            if not isinstance(string, str) or not 1 <= len(string) <= self.MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop_strings[{index}] must be a string of 1 to {self.MAX_STOP_STRING_CHARS} "
                    f"characters, got {string!r}"
                )
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def num_candidates(self) -> int:
        """First-step candidates a context worker sends: enough to start decoding exactly.

        Beam search needs the top 2W, greedy the top 1, sampling its top-k (0: the whole vocabulary).
        """
        if self.beam_width > 1:
            return 2 * self.beam_width
        return 1 if self.is_greedy else self.top_k

    @property
    def is_greedy(self) -> bool:
        return self.beam_width == 1 and self.temperature == 0


def check_engine_params(config: EngineConfig, params: SamplingParams) -> None:
    if params.beam_width > 1 and not config.supports_beam_search:
        raise ValueError("beam search needs enable_partial_commit off (cache.enable_partial_commit=True)")
