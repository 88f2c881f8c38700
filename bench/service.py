"""Service benchmark: the disaggregated service next to the aggregated server, in the same run.

    beamsplit bench service [--json] [--quick]        (or: python bench/service.py ...)

Starts (beamsplit.launch.launcher, through local_cluster) a context worker, a generation worker, a
coordinator and an aggregated server on loopback, all `--model tiny --dtype float32
--tokens-per-block 32`, and sends the same requests (token ids, beam width W, 32 new tokens) to the
coordinator and to the aggregated server, one at a time. Cases:

- `fresh`: a new random prompt for every request, so neither side reuses a cached prefix; prompts
  of 512 and 2048 tokens (and 64 with --quick), W = 1, 2, 4, 8.
- `reuse`: one prompt per length sent once to prime both sides, then sent again (W = 4); the
  second and later sends find the prompt in both prefix trees and pull only the last page.

Each row holds medians over the repeats of the coordinator's RequestStats (transferred blocks and
bytes, transfer, time to first token and end-to-end, measured from the request's arrival at the
front door; the two sends of one repeat go one after the other, in alternating order) and the
aggregated server's ttft / e2e, plus e2e_ratio = disaggregated / aggregated
and tokens_match (every beam's token ids equal on both sides, in every repeat). The point the
numbers make: transferred_bytes depends on the prompt length only, never on W. decode_ms and
aggregated_decode_ms (medians of e2e - ttft) and their decode_ratio follow the decode phase alone.

Requests go one at a time, so the workers never compute at once: they run in the thread layout
of a worker alone on its cores (no `--shares-cores`, docs/service.md "The engine thread"), as on
a host each. `--shared-cores` starts them as the one-host launcher does by default.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"
DTYPE = "float32"
BLOCK_SIZE = 32
MAX_NEW_TOKENS = 32
BEAM_WIDTHS = (1, 2, 4, 8)
PROMPT_LENS = (512, 2048)
QUICK_PROMPT_LENS = (64,)
REUSE_BEAM_WIDTH = 4
REQUEST_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 120.0
NUM_TOKEN_IDS = 256  # the tiny model's byte tokenizer: ids 0..255 are plain bytes
MEASURED_KEYS = ("transferred_blocks", "transferred_bytes", "transfer_ms", "ttft_ms", "e2e_ms")


# ---- pure helpers (tests/unit/test_bench_service.py) -------------------------------------------
def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(NUM_TOKEN_IDS) for _ in range(num_tokens)]


def summarize(
    case: str, prompt_tokens: int, beam_width: int, samples: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """One row: medians over the repeats. Each sample holds the coordinator's stats under its
    keys, `aggregated_ttft_ms`, `aggregated_e2e_ms` and `tokens_match`."""
    if not samples:
        raise ValueError(f"{case}: no samples")
    row: dict[str, Any] = {"case": case, "prompt_tokens": prompt_tokens, "beam_width": beam_width}
    for key in (*MEASURED_KEYS, "aggregated_ttft_ms", "aggregated_e2e_ms"):
        value = statistics.median(float(sample[key]) for sample in samples)
        row[key] = int(value) if key.startswith("transferred") else round(value, 3)
    # Bytes and blocks must not vary between repeats of one case; a spread is reported, not hidden.
    for key in ("transferred_blocks", "transferred_bytes"):
        values = sorted({int(sample[key]) for sample in samples})
        if len(values) > 1:
            row[f"{key}_seen"] = values
    row["tokens_match"] = all(bool(sample["tokens_match"]) for sample in samples)
    aggregated = row["aggregated_e2e_ms"]
    row["e2e_ratio"] = round(row["e2e_ms"] / aggregated, 3) if aggregated > 0 else None
    for prefix in ("", "aggregated_"):
        decode = statistics.median(
            float(sample[f"{prefix}e2e_ms"]) - float(sample[f"{prefix}ttft_ms"]) for sample in samples
        )
        row[f"{prefix}decode_ms"] = round(decode, 3)
    aggregated_decode = row["aggregated_decode_ms"]
    row["decode_ratio"] = round(row["decode_ms"] / aggregated_decode, 3) if aggregated_decode > 0 else None
    row["repeats"] = len(samples)
    return row


def bytes_by_width(rows: Sequence[dict[str, Any]], case: str = "fresh") -> dict[int, set[int]]:
    """prompt_tokens -> the distinct transferred_bytes over the beam widths (one value expected)."""
    seen: dict[int, set[int]] = {}
    for row in rows:
        if row["case"] == case:
            seen.setdefault(row["prompt_tokens"], set()).add(row["transferred_bytes"])
    return seen


# ---- the run -----------------------------------------------------------------------------------
def _say(message: str) -> None:
    print(f"[bench service] {message}", file=sys.stderr, flush=True)


def _one_request(
    coordinator: Any, aggregated: Any, prompt: list[int], beam_width: int, aggregated_first: bool = False
) -> dict[str, Any]:
    from beamsplit.client.grpc_client import build_request
    from beamsplit.v1 import common_pb2

    sampling = common_pb2.SamplingOptions(beam_width=beam_width, max_new_tokens=MAX_NEW_TOKENS)
    request = build_request(token_ids=prompt, sampling=sampling)
    # One at a time (never both at once on the same cores); the order alternates between repeats.
    if aggregated_first:
        reference = aggregated.generate(request, timeout_s=REQUEST_TIMEOUT_S)
    result = coordinator.generate(request, timeout_s=REQUEST_TIMEOUT_S)
    if not aggregated_first:
        reference = aggregated.generate(request, timeout_s=REQUEST_TIMEOUT_S)
    sample = {key: result.stats[key] for key in MEASURED_KEYS}
    sample["aggregated_ttft_ms"] = reference.stats["ttft_ms"]
    sample["aggregated_e2e_ms"] = reference.stats["e2e_ms"]
    sample["tokens_match"] = [beam.token_ids for beam in result.beams] == [
        beam.token_ids for beam in reference.beams
    ]
    return sample


def run_cases(
    coordinator_address: str, aggregated_address: str, quick: bool, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    from beamsplit.client.grpc_client import BeamsplitClient

    prompt_lens = QUICK_PROMPT_LENS if quick else PROMPT_LENS
    repeats = 2 if quick else 5
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    with (
        BeamsplitClient(coordinator_address) as coordinator,
        BeamsplitClient(aggregated_address) as aggregated,
    ):
        # Warm-up (first-call costs: UCX endpoints, torch kernels), not counted.
        _one_request(coordinator, aggregated, random_prompt(rng, 64), 2)
        for prompt_len in prompt_lens:
            for beam_width in BEAM_WIDTHS:
                samples = [
                    _one_request(
                        coordinator, aggregated, random_prompt(rng, prompt_len), beam_width, repeat % 2 == 1
                    )
                    for repeat in range(repeats)
                ]
                rows.append(summarize("fresh", prompt_len, beam_width, samples))
                progress(json.dumps(rows[-1]))
            prompt = random_prompt(rng, prompt_len)
            _one_request(coordinator, aggregated, prompt, REUSE_BEAM_WIDTH)  # primes both prefix trees
            samples = [
                _one_request(coordinator, aggregated, prompt, REUSE_BEAM_WIDTH, repeat % 2 == 1)
                for repeat in range(repeats)
            ]
            rows.append(summarize("reuse", prompt_len, REUSE_BEAM_WIDTH, samples))
            progress(json.dumps(rows[-1]))
    return rows


def run_benchmark(
    quick: bool, workers_share_cores: bool = False
) -> tuple[list[dict[str, Any]], dict[str, float | None]]:
    """Rows, and the KV blocks still in use on every engine server after the run (all 0 expected)."""
    from beamsplit.launch.local_cluster import start_local_cluster

    log_dir = Path(tempfile.mkdtemp(prefix="beamsplit-bench-service-"))
    engine_arguments = ["--model", "tiny", "--dtype", DTYPE, "--tokens-per-block", str(BLOCK_SIZE)]
    layout = "--shares-cores" if workers_share_cores else "alone on their cores"
    _say(f"server logs in {log_dir}; engine flags {' '.join(engine_arguments)}; workers {layout}")
    cluster = start_local_cluster(
        log_dir, engine_arguments, _say, STARTUP_TIMEOUT_S, workers_share_cores=workers_share_cores
    )
    try:
        started = time.monotonic()
        rows = run_cases(cluster.coordinator.address, cluster.aggregated.address, quick, _say)
        for row in rows:
            row["workers_share_cores"] = workers_share_cores
        _say(f"cases took {time.monotonic() - started:.1f} s")
        time.sleep(0.3)  # the engine loops publish occupancy after their next iteration
        blocks = cluster.blocks_in_use()
    finally:
        codes = cluster.stop()  # SIGTERM by pid, SIGKILL after a bound
        _say("servers stopped, exit codes: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    return rows, blocks


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    prompt_lens = sorted({row["prompt_tokens"] for row in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, prompt_len in enumerate(prompt_lens):
        color = colors[index % len(colors)]
        fresh = [row for row in rows if row["case"] == "fresh" and row["prompt_tokens"] == prompt_len]
        widths = [row["beam_width"] for row in fresh]
        left.plot(
            widths,
            [row["transferred_bytes"] / 1024 for row in fresh],
            marker="o",
            color=color,
            label=f"prompt {prompt_len}",
        )
        for row in rows:
            if row["case"] == "reuse" and row["prompt_tokens"] == prompt_len:
                left.scatter(
                    [row["beam_width"]],
                    [row["transferred_bytes"] / 1024],
                    marker="x",
                    color=color,
                    label=f"prompt {prompt_len}, repeated (reuse)",
                )
        right.plot(
            widths,
            [row["e2e_ms"] for row in fresh],
            marker="o",
            color=color,
            label=f"disaggregated, prompt {prompt_len}",
        )
        right.plot(
            widths,
            [row["aggregated_e2e_ms"] for row in fresh],
            marker="s",
            linestyle="--",
            color=color,
            label=f"aggregated, prompt {prompt_len}",
        )
    for axes in (left, right):
        axes.set_xscale("log", base=2)
        axes.set_xticks(list(BEAM_WIDTHS), [str(width) for width in BEAM_WIDTHS])
        axes.set_xlabel("beam width W")
        axes.legend(fontsize=8)
    left.set_ylim(bottom=0)
    left.set_ylabel("KiB pulled per request")
    left.set_title("prompt KV crosses the wire once, whatever W")
    right.set_ylim(bottom=0)
    right.set_ylabel("end-to-end ms (median)")
    right.set_title(f"tiny model, {DTYPE}, block {BLOCK_SIZE}, {MAX_NEW_TOKENS} new tokens, fresh prompts")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from beamsplit.cli.bench import add_service_arguments

    parser.add_argument("--json", action="store_true", help="print only the JSON list")
    add_service_arguments(parser)


def run(arguments: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    rows, blocks = run_benchmark(arguments.quick, arguments.shared_cores)
    plot_path = OUT_DIR / "service.png"
    plot(rows, plot_path)
    print(json.dumps(rows, indent=None if arguments.json else 1))
    is_ok = True
    for prompt_len, values in sorted(bytes_by_width(rows).items()):
        if len(values) != 1:
            _say(f"UNEXPECTED: prompt {prompt_len}: transferred_bytes varies with W: {sorted(values)}")
            is_ok = False
    leaked = {name: value for name, value in blocks.items() if value != 0}
    if leaked:
        _say(f"UNEXPECTED: KV blocks still in use after the run: {leaked}")
        is_ok = False
    _say(f"plot: {plot_path}")
    return 0 if is_ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
