"""Serving benchmark: the disaggregated service, the aggregated server and transformers `generate`
on one random Llama, one dtype and one replayed workload.

    beamsplit bench serve [--json] [--quick] [--num-requests N] [--rate R] ...   (or: python bench/serve.py ...)

Model: a random Llama of 156M parameters (bench/serve_model.py), written once as a Hugging Face
directory that all three systems load, float32. Deployments, started as separate processes on
loopback through beamsplit.launch.local_cluster and stopped by pid in a `finally` (also on Ctrl-C
and SIGTERM): coordinator + one context worker + one generation worker, and the aggregated server.
Workload (bench/serve_workload.py): Poisson arrivals, log-uniform prompt lengths, shared prefixes,
beam widths 1, 2, 4 in turn, eos ignored. The systems run one after the other, never at once:
disaggregated, aggregated, then (servers stopped) transformers.

Besides the replay: one greedy request alone (inter-token latency, aggregated vs transformers),
one fresh longest-prompt request alone on each deployment (TTFT), and one beam-4 request alone
(its peak KV blocks from the server's own counters, next to prompt + 4 tails and 4 full copies).
Prints one JSON object (goals next to the measured ratios) and draws bench/out/serve_summary.png
and bench/out/serve_cdf.png. Exit status 1 if a request failed, a token count is off, or a KV
pool is not back to 0 blocks in use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from beamsplit.cli.bench import load_bench_module

serve_model = load_bench_module("serve_model")
workload = load_bench_module("serve_workload")
clients = load_bench_module("serve_clients")
progress = load_bench_module("serve_progress")
report_rules = load_bench_module("serve_report")

OUT_DIR = Path(__file__).resolve().parent / "out"
DTYPE = "float32"
DTYPE_BYTES = 4
BLOCK_SIZE = report_rules.BLOCK_SIZE
STARTUP_TIMEOUT_S = 300.0
PROBE_BEAM_WIDTH = 4
ITL_PROMPT_LEN = 512
TTFT_REPEATS = report_rules.TTFT_REPEATS
ITL_REPEATS = report_rules.ITL_REPEATS
SYSTEM_INDEX = {"disaggregated": 0, "aggregated": 1}  # tells the fresh prompts of the probes apart
# --quick and the full run; an explicit flag wins over either.
FULL = {
    "num_requests": 20,
    # 0.5/s since stop 22: at 0.25/s (arrivals over 57 s) the faster kernels had both deployments
    # within 13% of the arrival ceiling, 2.14x transformers, so the ratio measured the rate.
    "rate": 0.5,
    "min_prompt_len": 128,
    "max_prompt_len": 4096,
    "max_new_tokens": 32,
    "itl_new_tokens": 64,
}
QUICK = {
    "num_requests": 6,
    "rate": 2.0,
    "min_prompt_len": 32,
    "max_prompt_len": 256,
    "max_new_tokens": 8,
    "itl_new_tokens": 16,
}


def _say(message: str) -> None:
    print(f"[bench serve] {message}", file=sys.stderr, flush=True)


# ---- the run -------------------------------------------------------------------------------------
def _replay_ours(
    name: str, address: str, servers: list[Any], specs: list[Any]
) -> tuple[list[Any], dict[str, Any]]:
    bar = progress.ProgressBar(f"{name} ({len(specs)} requests)", len(specs))
    try:
        with clients.KvSampler(servers) as sampler:
            records = clients.replay(address, specs, workload.RequestRecord, bar.advance, tag=f"bench-{name}")
    finally:
        bar.close()
    summary = workload.summarize_system(records)
    # Sampling every KV_SAMPLE_EVERY_S can miss a short-lived request altogether; a request's own
    # peak (its final stats) is a lower bound on the pools' peak, so the peak is never below it.
    own_peaks = [int(record.server_stats.get("peak_blocks", 0)) for record in records if record.is_ok]
    summary["peak_kv_blocks"] = max([sampler.peak_total, *own_peaks])
    summary["peak_kv_blocks_by_server"] = dict(sampler.peak_by_server)
    summary["kv_samples"] = sampler.num_samples
    summary["prompt_tokens_reused"] = sum(
        int(record.server_stats.get("context_reused_tokens", 0)) for record in records
    )
    return records, summary


def _fresh(
    specs_seed: int, length: int, vocab_size: int, beam_width: int, max_new_tokens: int, index: int
) -> Any:
    import random

    rng = random.Random(specs_seed * 1000 + index)
    prompt = tuple(rng.randrange(workload.FIRST_TOKEN_ID, vocab_size) for _ in range(length))
    return workload.RequestSpec(index, 0.0, prompt, beam_width, max_new_tokens, None)


def _samples(records: list[Any]) -> dict[str, list[float]]:
    finished = [record for record in records if record.is_ok]
    return {
        "ttft_ms": [record.ttft_s * 1000 for record in finished],
        "itl_ms": [gap * 1000 for record in finished for gap in record.inter_token_gaps_s()],
    }


def probe_itl(
    deployments: dict[str, str],
    reference: Callable[[Any], Any],
    settings: dict[str, Any],
    prompt_len: int,
    vocab_size: int,
    problems: list[str],
) -> dict[str, Any]:
    """One greedy request alone, ITL_REPEATS times on each deployment and through transformers
    (`reference`), in one window: a fresh prompt per repeat, the same on every system, and the
    systems' order rotating between repeats, so the host's noise falls on all three alike. Gaps
    are pooled over the repeats."""
    systems = [*deployments, "transformers"]
    records: dict[str, list[Any]] = {name: [] for name in systems}
    for repeat in range(ITL_REPEATS):
        spec = _fresh(1, prompt_len, vocab_size, 1, settings["itl_new_tokens"], repeat)
        shift = repeat % len(systems)
        for name in systems[shift:] + systems[:shift]:
            if name == "transformers":
                record = reference(spec)
            else:
                record = clients.run_alone(
                    deployments[name], spec, workload.RequestRecord, f"itl-{name}-{repeat}"
                )
            if record.is_ok:
                records[name].append(record)
            else:
                problems.append(f"single-request itl {name}, repeat {repeat}: {record.error or 'no tokens'}")
    result: dict[str, Any] = {"repeats": ITL_REPEATS}
    for name, found in records.items():
        if not found:
            result[name] = {"error": "no request finished"}
            continue
        gaps = [gap * 1000 for record in found for gap in record.inter_token_gaps_s()]
        result[name] = {
            "itl_ms_p50": round(workload.percentile(gaps, 0.5), 3),
            "itl_ms_p99": round(workload.percentile(gaps, 0.99), 3),
            "itl_ms_p50_per_request": [
                round(workload.percentile([gap * 1000 for gap in record.inter_token_gaps_s()], 0.5), 3)
                for record in found
            ],
            "ttft_ms_all": [round(record.ttft_s * 1000, 3) for record in found],
        }
    return result


def probe_ttft(
    deployments: dict[str, str], prompt_len: int, vocab_size: int, problems: list[str]
) -> dict[str, Any]:
    """A fresh (never cached) longest prompt alone, TTFT_REPEATS times per deployment, the order
    of the two alternating between repeats."""
    client_ms: dict[str, list[float]] = {name: [] for name in deployments}
    server_ms: dict[str, list[float]] = {name: [] for name in deployments}
    for repeat in range(TTFT_REPEATS):
        order = list(deployments) if repeat % 2 == 0 else list(reversed(deployments))
        for name in order:
            spec = _fresh(2, prompt_len, vocab_size, 1, 2, 2 * repeat + SYSTEM_INDEX[name])
            record = clients.run_alone(
                deployments[name], spec, workload.RequestRecord, f"ttft-{name}-{repeat}"
            )
            if record.is_ok:
                client_ms[name].append(record.ttft_s * 1000)
                server_ms[name].append(float(record.server_stats.get("ttft_ms", 0.0)))
            else:
                problems.append(f"ttft probe {name}: {record.error}")
    result: dict[str, Any] = {"prompt_tokens": prompt_len, "beam_width": 1, "repeats": TTFT_REPEATS}
    for name in deployments:
        values = client_ms[name]
        result[f"{name}_ttft_ms"] = round(workload.percentile(values, 0.5), 3) if values else None
        result[f"{name}_ttft_ms_all"] = [round(value, 3) for value in values]
        # The server's own clock: arrival at the front door to the first decided token.
        result[f"{name}_server_ttft_ms_all"] = [round(value, 3) for value in server_ms[name]]
    return result


def probe_beam_kv(
    deployments: dict[str, str], settings: dict[str, Any], preset: Any, problems: list[str]
) -> dict[str, Any]:
    """One beam-4 request alone: its own peak_blocks counter against prompt + 4 tails."""
    prompt_len = settings["max_prompt_len"] * 3 // 4 + BLOCK_SIZE // 2 + 1  # ends inside a block
    new_tokens = settings["max_new_tokens"]
    page_bytes = BLOCK_SIZE * preset.kv_bytes_per_token(DTYPE_BYTES)
    kv = report_rules.beam_kv_report(prompt_len, new_tokens, PROBE_BEAM_WIDTH, page_bytes)
    for name, address in deployments.items():
        spec = _fresh(3, prompt_len, preset.vocab_size, PROBE_BEAM_WIDTH, new_tokens, SYSTEM_INDEX[name])
        record = clients.run_alone(address, spec, workload.RequestRecord, f"kv-{name}")
        if not record.is_ok:
            problems.append(f"beam-4 kv probe {name}: {record.error}")
        peak = record.server_stats.get("peak_blocks") if record.is_ok else None
        kv[f"{name}_peak_blocks"] = peak
        kv[f"{name}_peak_bytes"] = None if peak is None else peak * page_bytes
    for key in ("shared_prompt_blocks", "prompt_plus_tails_blocks", "independent_copies_blocks"):
        kv[key.replace("blocks", "bytes")] = kv[key] * page_bytes
    # transformers keeps W contiguous rows of prompt + new tokens: 4 full copies, unpaged.
    kv["transformers_estimate_bytes"] = (
        PROBE_BEAM_WIDTH * (prompt_len + new_tokens) * preset.kv_bytes_per_token(DTYPE_BYTES)
    )
    return kv


def run_servers(
    settings: dict[str, Any],
    model_dir: Path,
    specs: list[Any],
    preset: Any,
    kv_cache_gib: float,
    report: dict[str, Any],
    reference: Any,
) -> dict[str, list[Any]]:
    """Both deployments: the replay on each in turn, then the requests alone (the greedy one
    alternating with `reference`, the loaded transformers system, which is idle otherwise)."""
    from beamsplit.launch.local_cluster import start_local_cluster

    page_bytes = BLOCK_SIZE * preset.kv_bytes_per_token(DTYPE_BYTES)
    log_dir = Path(tempfile.mkdtemp(prefix="beamsplit-bench-serve-"))
    engine_arguments = ["--model", str(model_dir), "--dtype", DTYPE, "--tokens-per-block", str(BLOCK_SIZE),
                        "--kv-cache-gib", str(kv_cache_gib)]  # fmt: skip
    report["servers"] = {
        "engine_arguments": engine_arguments,
        "log_dir": str(log_dir),
        "page_bytes": page_bytes,
    }
    _say(f"server logs in {log_dir}")
    cluster = start_local_cluster(log_dir, engine_arguments, _say, STARTUP_TIMEOUT_S)
    records: dict[str, list[Any]] = {}
    problems = report["checks"]["problems"]
    try:
        report["servers"]["kv_pool_blocks"] = cluster.aggregated.metric("beamsplit_kv_blocks_capacity")
        deployments = {"disaggregated": cluster.coordinator.address, "aggregated": cluster.aggregated.address}
        pools = {"disaggregated": [cluster.context, cluster.generation], "aggregated": [cluster.aggregated]}
        for address in deployments.values():  # first-call costs (UCX endpoints, kernels), not counted
            clients.run_alone(
                address, _fresh(7, 64, preset.vocab_size, 2, 4, 0), workload.RequestRecord, "warmup"
            )
        for name, address in deployments.items():
            records[name], report["systems"][name] = _replay_ours(name, address, pools[name], specs)
            report["systems"][name]["peak_kv_bytes"] = report["systems"][name]["peak_kv_blocks"] * page_bytes
        _say(
            f"requests alone: one greedy x {ITL_REPEATS} on each deployment and transformers (inter-token "
            f"latency), the longest prompt x {TTFT_REPEATS} (TTFT), one beam-4 (KV)"
        )
        report["single_request_itl"].update(
            probe_itl(
                deployments,
                reference.run_alone,
                settings,
                report["single_request_itl"]["prompt_tokens"],
                preset.vocab_size,
                problems,
            )
        )
        report["ttft_long_prompt_alone"] = probe_ttft(
            deployments, settings["max_prompt_len"], preset.vocab_size, problems
        )
        report["beam4_kv"] = probe_beam_kv(deployments, settings, preset, problems)
        time.sleep(0.5)  # the engine loops publish occupancy after their next iteration
        report["checks"]["kv_blocks_in_use_after"] = cluster.blocks_in_use()
    finally:
        codes = cluster.stop()  # SIGTERM by pid, SIGKILL after a bound
        _say("servers stopped, exit codes: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    return records


def load_transformers(model_dir: Path, preset: Any, report: dict[str, Any]) -> Any:
    """transformers on the same checkpoint, loaded and warmed up before our servers start (it
    idles while they replay, and runs the greedy request alone next to theirs)."""
    reference = load_bench_module("serve_transformers")
    _say("loading the model into transformers")
    system = reference.TransformersSystem(
        model_dir, preset.kv_bytes_per_token(DTYPE_BYTES), workload.RequestRecord
    )
    report["transformers"] = system.describe()
    system.generate([list(range(3, 67))], 2, 4)  # warm-up, not counted
    system.peak_kv_bytes = 0
    return system


def run_transformers(system: Any, specs: list[Any], report: dict[str, Any]) -> list[Any]:
    """The same replay through transformers `generate`, after our servers are stopped."""
    system.peak_kv_bytes = 0  # the replay's batches only, not the greedy probe's
    bar = progress.ProgressBar(f"transformers ({len(specs)} requests)", len(specs))
    try:
        records = system.replay(specs, bar.advance)
        report["systems"]["transformers"] = {
            **workload.summarize_system(records),
            "peak_kv_bytes": system.peak_kv_bytes,
        }
    finally:
        bar.close()
    return records


def resolve_settings(arguments: argparse.Namespace) -> dict[str, Any]:
    """--quick's or the full run's sizes, each overridden by its flag when given."""
    base = QUICK if arguments.quick else FULL
    settings = {
        key: value if getattr(arguments, key, None) is None else getattr(arguments, key)
        for key, value in base.items()
    }
    if arguments.model not in serve_model.PRESETS:
        raise ValueError(f"--model must be one of {sorted(serve_model.PRESETS)}, got {arguments.model!r}")
    return settings


def run_benchmark(arguments: argparse.Namespace) -> tuple[dict[str, Any], int]:
    started = time.monotonic()
    settings = resolve_settings(arguments)
    preset = serve_model.PRESETS[arguments.model]
    _say(f"model {preset.name}: {preset.num_parameters / 1e6:.1f}M parameters, {DTYPE}")
    model_dir = serve_model.ensure_checkpoint(
        preset, Path(arguments.model_dir or serve_model.DEFAULT_CACHE_DIR)
    )
    config = workload.WorkloadConfig(
        num_requests=settings["num_requests"], rate=settings["rate"], min_prompt_len=settings["min_prompt_len"],
        max_prompt_len=settings["max_prompt_len"], max_new_tokens=settings["max_new_tokens"],
        beam_widths=tuple(arguments.beam_widths), prefix_share=arguments.prefix_share, num_prefixes=2,
        vocab_size=preset.vocab_size, seed=arguments.seed,
    )  # fmt: skip
    specs = workload.make_workload(config)
    report: dict[str, Any] = {
        "benchmark": "serve",
        "model": {**preset.describe(), "dir": str(model_dir), "dtype": DTYPE},
        "host": {
            "cpu_count": os.cpu_count(),
            "load_average_at_start": [round(value, 2) for value in os.getloadavg()],
        },
        "workload": workload.describe_workload(config, specs),
        "definitions": report_rules.DEFINITIONS,
        "systems": {},
        "single_request_itl": {
            "prompt_tokens": min(ITL_PROMPT_LEN, config.max_prompt_len),
            "beam_width": 1,
            "max_new_tokens": settings["itl_new_tokens"],
        },  # fmt: skip
        "checks": {"problems": []},
    }
    reference = load_transformers(model_dir, preset, report)
    records = run_servers(settings, model_dir, specs, preset, arguments.kv_cache_gib, report, reference)
    records["transformers"] = run_transformers(reference, specs, report)
    report["goals"] = report_rules.build_goals(report)
    checks = report["checks"]
    count_problems = [
        problem
        for name, found in records.items()
        for problem in report_rules.token_count_problems(name, specs, found)
    ]
    checks["token_counts_consistent"] = not count_problems
    checks["problems"] += count_problems
    leaked = {name: value for name, value in checks["kv_blocks_in_use_after"].items() if value != 0}
    checks["problems"] += [
        f"{name}: {value} KV blocks still in use after the run" for name, value in leaked.items()
    ]
    out_dir = Path(arguments.out_dir or OUT_DIR)
    plots = load_bench_module("serve_plots")
    title = (f"{preset.name} ({preset.num_parameters / 1e6:.3g}M, {DTYPE}), {config.num_requests} requests, "
             f"Poisson {config.rate}/s, prompts {config.min_prompt_len}-{config.max_prompt_len}, "
             f"W {list(config.beam_widths)}, {config.max_new_tokens} new tokens")  # fmt: skip
    summary_path, cdf_path = out_dir / "serve_summary.png", out_dir / "serve_cdf.png"
    plots.plot_summary(report["systems"], title, summary_path)
    plots.plot_cdfs({name: _samples(found) for name, found in records.items()}, title, cdf_path)
    report["plots"] = [str(summary_path), str(cdf_path)]
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report, 1 if checks["problems"] else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from beamsplit.cli.bench import add_serve_arguments

    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    add_serve_arguments(parser)


def run(arguments: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # beamsplit/cli/bench.py turns SIGTERM into SystemExit: the `finally` stops the servers.
    report, status = run_benchmark(arguments)
    print(json.dumps(report, indent=None if arguments.json else 1))
    for goal in report["goals"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        _say(f"goal {goal['goal']}: {goal['measured']} ({goal['direction']} {goal['bound']}) {verdict}")
    for problem in report["checks"]["problems"]:
        _say(f"PROBLEM: {problem}")
    for path in report["plots"]:
        _say(f"plot: {path}")
    return status


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
