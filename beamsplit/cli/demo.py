"""`beamsplit demo`: the whole disaggregated service on loopback, checked against the aggregated run.

Starts a context worker, a generation worker, a coordinator and an aggregated server as separate
processes (SmolLM2-135M-Instruct by default, float64 so that parity is exact; `--model tiny` for the
fast random model), sends a few prompts through the coordinator and the same prompts to the
aggregated server, prints every beam's text with its stats and whether it equals the aggregated
beam, then stops everything by pid. Exit status 0 only when every beam matched, every KV pool is
back to zero blocks in use and every server exited cleanly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from beamsplit.cli.output import beam_record, format_result

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
BLOCK_SIZE = 32
DEMO_KV_CACHE_GIB = 0.125  # per engine: 44 pages of SmolLM2 in float64, 4096 of tiny
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
    is_chat: bool = False  # the prompt is a user message, sent through the model's chat template


PACIFIC = (
    "The Pacific Ocean is the largest and deepest of the Earth's oceans. It stretches from the Arctic "
    "in the north to the Southern Ocean in the south, and it"
)  # 32 SmolLM2 tokens: exactly one block
PHOTOSYNTHESIS = (
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to "
    "make their own food. The main product of this process is"
)  # 29 tokens: one partial block
REAL_MODEL_CASES = (
    DemoCase("plain text, beam width 1", PACIFIC, 1),
    DemoCase("chat message, beam width 2", "What is the capital of France?", 2, is_chat=True),
    DemoCase("plain text, beam width 4", PHOTOSYNTHESIS, 4),
    DemoCase("the chat message again, beam width 4 (prefix reuse on both sides)", "What is the capital of France?", 4, is_chat=True),
)  # fmt: skip
# `tiny` is byte-level: one token per byte.
TINY_CASES = (
    DemoCase("plain text, beam width 1", "The quick brown fox jumps over the lazy dog while the cat sleeps."[:64], 1),
    DemoCase("plain text, beam width 2", "Disaggregated inference ships the prompt's KV pages exactly once, ok?"[:67], 2),
    DemoCase("plain text again, beam width 4", "The quick brown fox jumps over the lazy dog while the cat sleeps."[:64], 4),
    DemoCase("plain text repeated, beam width 2 (prefix reuse on both sides)", "Disaggregated inference ships the prompt's KV pages exactly once, ok?"[:67], 2),
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run coordinator + context + generation workers on loopback and check parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"what every server loads: {DEFAULT_MODEL} (SmolLM2-135M-Instruct, real text) or tiny "
        f"(random weights, fastest), or any --model value of `serve` (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, help="per request (default: 16)")
    parser.add_argument(
        "--dtype",
        default="float64",
        choices=("float32", "float64", "bfloat16"),
        help="dtype of every server (default: float64, the exact-parity setting; bfloat16 is the "
        "fastest on a CPU with native bfloat16, and its disaggregated beams equal the aggregated ones too)",
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
    from beamsplit.launch.local_cluster import start_local_cluster
    from engine.models.loader import load_model_tokenizer
    from engine.models.source import resolve_model_source

    try:
        resolve_model_source(args.model)  # a missing model is named before any server starts
    except FileNotFoundError as error:
        _say(str(error))
        return 1
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="beamsplit-demo-"))
    engine_arguments = [
        "--model", args.model, "--dtype", args.dtype, "--tokens-per-block", str(BLOCK_SIZE),
        "--kv-cache-gib", str(DEMO_KV_CACHE_GIB),  # each engine's pool: a memory budget, not a block count
        "--batch-invariant",  # each case's two runs go at once: exact whatever shares the batch
    ]  # fmt: skip
    _say(f"model {args.model}, {args.dtype}; server logs in {log_dir}")
    # The demo's own tokenizer (prompt lengths, chat template) loads while the servers start.
    with ThreadPoolExecutor(max_workers=1) as loader:
        tokenizer_future = loader.submit(load_model_tokenizer, args.model)
        try:
            cluster = start_local_cluster(log_dir, engine_arguments, _say, args.startup_timeout_s)
        except RuntimeError as error:
            _say(f"could not start the servers: {error}")
            return 1
    try:
        tokenizer = tokenizer_future.result()
    except (OSError, ValueError) as error:
        _say(f"cannot load the tokenizer of {args.model!r}: {error}")
        cluster.stop()
        return 1
    cases = TINY_CASES if tokenizer.chat_template is None else REAL_MODEL_CASES
    is_ok = False
    try:
        is_ok = _run_cases(
            cluster.coordinator.address, cluster.aggregated.address, cases, tokenizer, args.max_new_tokens
        )
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


def _run_cases(
    coordinator_address: str,
    aggregated_address: str,
    cases: tuple[DemoCase, ...],
    tokenizer: Tokenizer,
    max_new_tokens: int,
) -> bool:
    from beamsplit.client.grpc_client import BeamsplitClient, build_request
    from beamsplit.v1 import common_pb2

    is_ok = True
    with (
        BeamsplitClient(coordinator_address) as coordinator,
        BeamsplitClient(aggregated_address) as aggregated,
    ):
        for index, case in enumerate(cases, start=1):
            sampling = common_pb2.SamplingOptions(beam_width=case.beam_width, max_new_tokens=max_new_tokens)
            if case.is_chat:
                assert tokenizer.chat_template is not None
                text = tokenizer.chat_template.render([{"role": "user", "content": case.prompt}])
                token_ids = tokenizer.encode(text)  # the template's special tokens stay whole
                request = build_request(token_ids=token_ids, sampling=sampling)
            else:
                token_ids = tokenizer.encode(case.prompt)
                request = build_request(prompt=case.prompt, sampling=sampling)
            started = time.monotonic()
            # Both deployments at once: they are separate processes, and the demo's minute is short.
            with ThreadPoolExecutor(max_workers=1) as other:
                reference_future = other.submit(aggregated.generate, request, 120.0)
                result = coordinator.generate(request, timeout_s=120.0)
                reference = reference_future.result(timeout=150.0)
            print(f"\n=== {index}. {case.title}, {_describe_length(len(token_ids))}", flush=True)
            print(f"    {'user message' if case.is_chat else 'prompt'}: {case.prompt!r}", flush=True)
            records = [beam_record(beam, text) for beam, text in zip(result.beams, result.texts, strict=True)]
            stats = {name: result.stats[name] for name in SHOWN_STATS}
            print(_indent(format_result(records, stats, as_json=False)), flush=True)
            matches, worst = _compare(result.beams, reference.beams)
            is_ok = is_ok and matches
            verdict = "equal" if matches else "DIFFERENT"
            print(
                f"    parity with the aggregated server: {verdict} "
                f"({len(result.beams)} beams, token ids identical: {matches}, max |score diff| {worst:.1e}; "
                f"both runs {time.monotonic() - started:.1f} s)",
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


def _describe_length(num_tokens: int) -> str:
    full, rest = divmod(num_tokens, BLOCK_SIZE)
    if rest == 0:
        return f"{num_tokens} tokens = {full} full block{'s' if full > 1 else ''} of {BLOCK_SIZE}"
    return f"{num_tokens} tokens = {full} full + 1 partial block of {BLOCK_SIZE}"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(
        run(
            argparse.Namespace(
                model=DEFAULT_MODEL, max_new_tokens=16, dtype="float64", startup_timeout_s=180.0, log_dir=None
            )
        )
    )
