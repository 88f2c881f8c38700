"""The serving benchmark's checks and verdicts: token counts, the beam KV bound, the goals.

Pure Python on the report's plain numbers (tests/unit/test_bench_serve.py checks them exactly).
Loaded by bench/serve.py as a sibling module.
"""

from __future__ import annotations

import math
from typing import Any

BLOCK_SIZE = 32
TTFT_REPEATS = 5  # fresh longest prompts per deployment, alone, alternating (median)
ITL_REPEATS = 3  # greedy requests alone per system, the systems' order rotating (gaps pooled)


DEFINITIONS = {
    "beam_tokens": "tokens across a request's live beams: a width-W request decoding n steps makes W x n; "
    "counted from the stream (our servers) or W x steps (transformers)",
    "beam_tokens_per_s": "all finished requests' beam tokens / (last final - first scheduled arrival)",
    "ttft": "scheduled arrival (the client's send) to the first streamed token (transformers: the first "
    "decode step of the batch that took the request)",
    "itl": "gap between consecutive streamed decode steps of one request, pooled over requests; a message "
    "carrying k steps counts as k gaps of its wait / k",
    "peak_kv_bytes": "ours: largest sampled beamsplit_kv_blocks_in_use (summed over context and generation "
    "worker per sampling round, every 0.2 s) x page bytes; transformers: cache-shape estimate",
}


def token_count_problems(system: str, specs: list[Any], records: list[Any]) -> list[str]:
    """Every finished request made W x max_new_tokens beam tokens, all its beams max_new_tokens long."""
    problems = []
    for spec, record in zip(specs, records, strict=True):
        if not record.is_ok:
            problems.append(f"{system} request {spec.index}: {record.error or 'no tokens'}")
            continue
        if record.num_beam_tokens != spec.num_beam_tokens:
            problems.append(
                f"{system} request {spec.index}: {record.num_beam_tokens} beam tokens, expected {spec.num_beam_tokens}"
            )
        if record.final_lengths != [spec.max_new_tokens] * spec.beam_width:
            problems.append(f"{system} request {spec.index}: beam lengths {record.final_lengths}")
    return problems


def beam_kv_report(prompt_len: int, max_new_tokens: int, beam_width: int, page_bytes: int) -> dict[str, Any]:
    """Blocks of one beam request: the shared prompt once plus W private tails, and W full copies.

    |<- floor(P/T) full prompt blocks: shared ->|<- tail: partial prompt block + new tokens ->|
    """
    total_len = prompt_len + max_new_tokens
    shared = prompt_len // BLOCK_SIZE
    tail = math.ceil(total_len / BLOCK_SIZE) - shared
    return {
        "prompt_tokens": prompt_len,
        "max_new_tokens": max_new_tokens,
        "beam_width": beam_width,
        "shared_prompt_blocks": shared,
        "tail_blocks_per_beam": tail,
        "prompt_plus_tails_blocks": shared + beam_width * tail,
        "independent_copies_blocks": beam_width * math.ceil(total_len / BLOCK_SIZE),
        "page_bytes": page_bytes,
    }


def build_goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    systems = report["systems"]
    transformers_tps = systems.get("transformers", {}).get("beam_tokens_per_s")
    ceiling = report.get("workload", {}).get("arrival_ceiling_beam_tokens_per_s")
    ceiling_ratio = ratio(ceiling, transformers_tps)
    goals = [
        goal(
            f"{name} throughput >= 2x transformers",
            ratio(systems.get(name, {}).get("beam_tokens_per_s"), transformers_tps),
            2.0,
            True,
            f"{name} beam_tokens_per_s / transformers beam_tokens_per_s, same workload"
            + (
                ""
                if ceiling_ratio is None
                else f"; the arrivals cap any system at {ceiling} beam tok/s, {ceiling_ratio:.2f}x transformers"
            ),
        )
        for name in ("disaggregated", "aggregated")
    ]
    itl = report["single_request_itl"]
    goals.append(
        goal(
            "single-request inter-token latency <= 1.2x transformers",
            ratio(itl.get("aggregated", {}).get("itl_ms_p50"), itl.get("transformers", {}).get("itl_ms_p50")),
            1.2,
            False,
            f"aggregated itl_ms_p50 / transformers itl_ms_p50: a greedy request alone, {ITL_REPEATS} "
            "times on each, the systems alternating in one window, gaps pooled",
        )
    )
    ttft = report["ttft_long_prompt_alone"]
    goals.append(
        goal(
            f"disaggregated TTFT <= 1.1x aggregated ({ttft['prompt_tokens']}-token prompt)",
            ratio(ttft.get("disaggregated_ttft_ms"), ttft.get("aggregated_ttft_ms")),
            1.1,
            False,
            f"median over {TTFT_REPEATS} fresh prompts each, one request alone",
        )
    )
    kv = report["beam4_kv"]
    for name in ("disaggregated", "aggregated"):
        goals.append(
            goal(
                f"{name} beam-4 KV <= shared prompt + 4 tails",
                ratio(kv.get(f"{name}_peak_blocks"), kv["prompt_plus_tails_blocks"]),
                1.0,
                False,
                f"{name} peak_blocks (the request's own counter) / prompt_plus_tails_blocks",
            )
        )
    return goals


def goal(name: str, measured: float | None, bound: float, at_least: bool, how: str) -> dict[str, Any]:
    """One goal next to its measured value; `met` is None when it could not be measured."""
    if measured is None:
        met = None
    else:
        met = measured >= bound if at_least else measured <= bound
    return {
        "goal": name,
        "measured": None if measured is None else round(measured, 3),
        "bound": bound,
        "direction": ">=" if at_least else "<=",
        "met": met,
        "how": how,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
