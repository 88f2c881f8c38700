"""`beamsplit demo`: the whole disaggregated service on loopback, checked against the aggregated run.

Starts a context worker, a generation worker, a coordinator and an aggregated server as separate
processes (`--model tiny`, float64 so that parity is exact), sends a few prompts through the
coordinator and the same prompts to the aggregated server, prints every beam with its stats and
whether it equals the aggregated beam, then stops everything by pid. Exit status 0 only when
every beam matched, every KV pool is back to zero blocks in use and every server exited cleanly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from beamsplit.output import beam_record, format_result

ALIGNED_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps."[:64]
UNALIGNED_PROMPT = "Disaggregated inference ships the prompt's KV pages exactly once, ok?"[:67]
MAX_SCORE_DIFFERENCE = 1e-9  # float64: beams must agree far below any score gap
SHOWN_STATS = (
    "prompt_tokens", "context_reused_tokens", "generation_reused_tokens", "transferred_blocks",
    "transferred_bytes", "transfer_ms", "ttft_ms", "e2e_ms", "context_worker", "generation_worker",
)  # fmt: skip


@dataclass(frozen=True)
class DemoCase:
    title: str
    prompt: str
    beam_width: int


CASES = (
    DemoCase("block-aligned prompt (64 tokens), beam width 1", ALIGNED_PROMPT, 1),
    DemoCase("unaligned prompt (67 tokens), beam width 2", UNALIGNED_PROMPT, 2),
    DemoCase("block-aligned prompt (64 tokens) again, beam width 4", ALIGNED_PROMPT, 4),
    DemoCase("unaligned prompt repeated, beam width 2 (reuse on both sides)", UNALIGNED_PROMPT, 2),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run coordinator + context + generation workers on loopback and check parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--max-new-tokens", type=int, default=12, help="per request (default: 12)")
    parser.add_argument(
        "--dtype",
        default="float64",
        choices=("float32", "float64"),
        help="dtype of every server (default: float64, the exact-parity setting)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=180.0,
        help="bound on servers becoming healthy (default: 180)",
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="server logs (default: a temporary directory)"
    )
    parser.set_defaults(handler=run)


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def run(args: argparse.Namespace) -> int:
    from beamsplit.local_cluster import start_local_cluster

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="beamsplit-demo-"))
    engine_arguments = ["--model", "tiny", "--dtype", args.dtype, "--tokens-per-block", "32"]
    _say(f"server logs in {log_dir}")
    try:
        cluster = start_local_cluster(log_dir, engine_arguments, _say, args.startup_timeout_s)
    except RuntimeError as error:
        _say(f"could not start the servers: {error}")
        return 1
    is_ok = False
    try:
        is_ok = _run_cases(cluster.coordinator.address, cluster.aggregated.address, args.max_new_tokens)
        time.sleep(0.3)  # the engine loops publish occupancy after their next iteration
        blocks = cluster.blocks_in_use()
        _say(
            "KV blocks in use after the run: "
            + ", ".join(f"{name} {value:g}" for name, value in blocks.items())
        )
        is_ok = is_ok and all(value == 0 for value in blocks.values())
    except Exception as error:  # the servers must be stopped whatever went wrong
        _say(f"failed: {type(error).__name__}: {error}")
        is_ok = False
    finally:
        _say("stopping servers (SIGTERM by pid)")
        codes = cluster.stop()
        _say("exit codes: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    is_ok = is_ok and all(code == 0 for code in codes.values())
    _say("PASS: every disaggregated beam equals the aggregated run" if is_ok else "FAIL")
    return 0 if is_ok else 1


def _run_cases(coordinator_address: str, aggregated_address: str, max_new_tokens: int) -> bool:
    from beamsplit.client import BeamsplitClient, build_request
    from beamsplit.v1 import common_pb2

    is_ok = True
    with (
        BeamsplitClient(coordinator_address) as coordinator,
        BeamsplitClient(aggregated_address) as aggregated,
    ):
        for index, case in enumerate(CASES, start=1):
            sampling = common_pb2.SamplingOptions(beam_width=case.beam_width, max_new_tokens=max_new_tokens)
            request = build_request(prompt=case.prompt, sampling=sampling)
            result = coordinator.generate(request, timeout_s=120.0)
            reference = aggregated.generate(request, timeout_s=120.0)
            print(f"\n=== {index}. {case.title}\n    prompt: {case.prompt!r}", flush=True)
            records = [beam_record(beam, text) for beam, text in zip(result.beams, result.texts, strict=True)]
            stats = {name: result.stats[name] for name in SHOWN_STATS}
            print(_indent(format_result(records, stats, as_json=False)), flush=True)
            matches, worst = _compare(result.beams, reference.beams)
            is_ok = is_ok and matches
            verdict = "equal" if matches else "DIFFERENT"
            print(
                f"    parity with the aggregated server: {verdict} "
                f"({len(result.beams)} beams, token ids identical: {matches}, max |score diff| {worst:.1e})",
                flush=True,
            )
    print(flush=True)
    return is_ok


def _compare(beams: list, reference: list) -> tuple[bool, float]:  # type: ignore[type-arg]
    if len(beams) != len(reference):
        return False, float("inf")
    worst = 0.0
    for beam, expected in zip(beams, reference, strict=True):
        if beam.token_ids != expected.token_ids or beam.finish_reason != expected.finish_reason:
            return False, float("inf")
        worst = max(
            worst,
            abs(beam.score - expected.score),
            abs(beam.cumulative_logprob - expected.cumulative_logprob),
        )
    return worst <= MAX_SCORE_DIFFERENCE, worst


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(
        run(argparse.Namespace(max_new_tokens=12, dtype="float64", startup_timeout_s=180.0, log_dir=None))
    )
