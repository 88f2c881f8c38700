"""The serving benchmark's workload and the arithmetic on what the systems did with it.

Pure Python (no torch, no gRPC), so tests/unit/test_bench_serve.py checks it exactly.

A workload is a seeded list of requests, each with an arrival offset (Poisson: exponential gaps
at `rate` per second), a prompt (token ids), a beam width and `max_new_tokens`. Prompt lengths are
log-uniform in [min_prompt_len, max_prompt_len] (many short prompts, few long ones); a share of the
prompts starts with one of a few shared prefixes (a quarter of the longest prompt each).

What a system returns per request is a `RequestRecord`: the wall-clock times at which the client
saw each decode step, and how many beam tokens (tokens across the live beams) came with it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FIRST_TOKEN_ID = 3  # ids 0..2 are pad, bos and eos in the benchmark model's config


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int
    rate: float  # arrivals per second (Poisson)
    min_prompt_len: int
    max_prompt_len: int
    max_new_tokens: int
    beam_widths: tuple[int, ...]
    prefix_share: float  # fraction of requests whose prompt starts with a shared prefix
    num_prefixes: int
    vocab_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not 1 <= self.min_prompt_len <= self.max_prompt_len:
            raise ValueError(
                f"prompt lengths need 1 <= min_prompt_len <= max_prompt_len, got {self.min_prompt_len}, {self.max_prompt_len}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.beam_widths or min(self.beam_widths) < 1:
            raise ValueError(f"beam_widths must be positive, got {self.beam_widths}")
        if not 0 <= self.prefix_share <= 1:
            raise ValueError(f"prefix_share must be in [0, 1], got {self.prefix_share}")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {self.vocab_size}")

    @property
    def prefix_len(self) -> int:
        return max(1, self.max_prompt_len // 4)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # offset from the start of the replay
    prompt_ids: tuple[int, ...]
    beam_width: int
    max_new_tokens: int
    prefix_index: int | None  # which shared prefix the prompt starts with, if any

    @property
    def num_beam_tokens(self) -> int:
        """Beam tokens a length-finished request produces: every beam decodes max_new_tokens."""
        return self.beam_width * self.max_new_tokens


def make_workload(config: WorkloadConfig) -> list[RequestSpec]:
    rng = random.Random(config.seed)

    def random_ids(length: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_TOKEN_ID, config.vocab_size) for _ in range(length))

    prefixes = [random_ids(config.prefix_len) for _ in range(config.num_prefixes)]
    log_low, log_high = math.log(config.min_prompt_len), math.log(config.max_prompt_len)
    specs: list[RequestSpec] = []
    arrival_s = 0.0
    for index in range(config.num_requests):
        if index > 0:
            arrival_s += rng.expovariate(config.rate)
        prompt_len = min(config.max_prompt_len, round(math.exp(rng.uniform(log_low, log_high))))
        prefix_index: int | None = None
        prompt = random_ids(prompt_len)
        if prefixes and rng.random() < config.prefix_share and prompt_len > config.prefix_len:
            prefix_index = rng.randrange(len(prefixes))
            prompt = prefixes[prefix_index] + prompt[config.prefix_len :]
        beam_width = config.beam_widths[index % len(config.beam_widths)]
        specs.append(RequestSpec(index, arrival_s, prompt, beam_width, config.max_new_tokens, prefix_index))
    return specs


def describe_workload(config: WorkloadConfig, specs: Sequence[RequestSpec]) -> dict[str, Any]:
    lengths = sorted(len(spec.prompt_ids) for spec in specs)
    return {
        "num_requests": config.num_requests,
        "arrivals": f"Poisson, {config.rate} requests/s (exponential gaps), seed {config.seed}",
        "duration_of_arrivals_s": round(specs[-1].arrival_s, 3),
        "prompt_len": f"log-uniform in [{config.min_prompt_len}, {config.max_prompt_len}] tokens",
        "prompt_len_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "prompt_tokens_total": sum(lengths),
        "shared_prefixes": f"{config.num_prefixes} prefixes of {config.prefix_len} tokens, "
        f"asked for by a share {config.prefix_share} of the requests (prompts longer than a prefix only)",
        "requests_with_shared_prefix": sum(spec.prefix_index is not None for spec in specs),
        "beam_widths": f"{list(config.beam_widths)} in turn",
        "requests_per_beam_width": {
            str(width): sum(spec.beam_width == width for spec in specs) for width in config.beam_widths
        },
        "max_new_tokens": config.max_new_tokens,
        "eos": "ignored: every beam decodes max_new_tokens (ignore_eos; transformers: no eos)",
        "beam_tokens_total": sum(spec.num_beam_tokens for spec in specs),
        # Throughput is counted from the first arrival to the last final message, so no system can
        # beat all beam tokens over the arrivals' span: at a low rate this caps every ratio.
        "arrival_ceiling_beam_tokens_per_s": arrival_ceiling(specs),
    }


def arrival_ceiling(specs: Sequence[RequestSpec]) -> float | None:
    """All beam tokens over the span of the arrivals: an upper bound on any system's throughput
    (the last request cannot finish before it arrives); None when every request arrives at once."""
    span_s = specs[-1].arrival_s - specs[0].arrival_s
    return round(sum(spec.num_beam_tokens for spec in specs) / span_s, 3) if span_s > 0 else None


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are wall-clock seconds (time.monotonic)."""

    index: int
    beam_width: int
    sent_s: float
    step_times_s: list[float] = field(default_factory=list)  # one entry per message with tokens
    step_counts: list[int] = field(default_factory=list)  # decode steps that message advanced
    num_beam_tokens: int = 0  # tokens across the live beams, summed over the stream
    final_lengths: list[int] = field(default_factory=list)  # each returned beam's token count
    finish_reasons: list[str] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None
    server_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.end_s is not None and bool(self.step_times_s)

    @property
    def ttft_s(self) -> float:
        return self.step_times_s[0] - self.sent_s

    def inter_token_gaps_s(self) -> list[float]:
        """Per decode step after the first: the wait for it. A message that carries k steps
        stands for k gaps of (its wait / k), so a coalesced stream is not counted as faster."""
        gaps: list[float] = []
        steps = zip(self.step_times_s[:-1], self.step_times_s[1:], self.step_counts[1:], strict=True)
        for previous, now, count in steps:
            gaps.extend([(now - previous) / count] * count)
        return gaps


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_system(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Throughput and latency percentiles over the requests that finished."""
    finished = [record for record in records if record.is_ok]
    summary: dict[str, Any] = {
        "requests": len(records),
        "requests_ok": len(finished),
        "errors": sorted({record.error for record in records if record.error is not None}),
    }
    if not finished:
        return summary
    started = min(record.sent_s for record in records)
    ended = max(record.end_s for record in finished if record.end_s is not None)
    num_tokens = sum(record.num_beam_tokens for record in finished)
    ttfts = [record.ttft_s * 1000 for record in finished]
    gaps = [gap * 1000 for record in finished for gap in record.inter_token_gaps_s()]
    summary.update(
        {
            "generated_beam_tokens": num_tokens,
            "wall_s": round(ended - started, 3),
            "beam_tokens_per_s": round(num_tokens / (ended - started), 3),
            "ttft_ms_p50": round(percentile(ttfts, 0.5), 3),
            "ttft_ms_p99": round(percentile(ttfts, 0.99), 3),
        }
    )
    if gaps:
        summary["itl_ms_p50"] = round(percentile(gaps, 0.5), 3)
        summary["itl_ms_p99"] = round(percentile(gaps, 0.99), 3)
    return summary
