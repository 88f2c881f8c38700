"""beamsplit against the CPU engines a new user would try, one after the other on this host:

    beamsplit bench peers [--json] [--quick] [--threads N]   (or: python bench/peers.py ...)

Systems, each in its own process(es), never two at once, with the same thread count, in rounds
(every system and precision once a round, started afresh each time; 3 rounds, medians over them,
so that the shared host's drift between minutes falls on all of them alike): beamsplit
aggregated and disaggregated through their HTTP front (`use_beam_search`, `ignore_eos`),
transformers `generate`, OpenVINO GenAI's ContinuousBatchingPipeline and CTranslate2's
`generate_batch` (bench/peers_systems.py). Precisions: float32, and bfloat16 where the CPU has
native bf16 (AMX or AVX512-BF16; the JSON lists the flags it found, or why bf16 was skipped).
Model: SmolLM2-135M from the packaged GGUF, de-quantized once into a Hugging Face directory that
every system loads or converts (bench/peers_setup.py; the peers get a venv of their own,
installed on first use). `--quick`: a 2-layer random Llama, short prompts and few tokens, and no
peer but transformers unless the peers' venv is already there (the test suite runs it).

Per system and precision: one request alone (a 256-token prompt, beam 4, 64 new tokens; the
first of each round, cold, then a warm one, each round's with a prompt of its own so that no prefix
cache answers; the median of the rounds' warm ones), 16 requests at once (prompts of 69 to 357 tokens, seeded,
beam 4, 64 new tokens), TTFT and inter-token latency of a streamed greedy request (beamsplit:
beams are decided at the end, so only greedy streams), resident memory, top-beam agreement with
transformers float32, ratios to the fastest peer; the host's limits (a large GEMM's FLOP/s, the
copy bandwidth) measured first in the same run; goals computed from the run. Prints one JSON
object and draws bench/out/peers.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from beamsplit.cli.bench import load_bench_module

rules = load_bench_module("peers_report")
setup = load_bench_module("peers_setup")
serve_model = load_bench_module("serve_model")

OUT_DIR = Path(__file__).resolve().parent / "out"
SYSTEMS_SCRIPT = Path(__file__).resolve().with_name("peers_systems.py")
MODEL = "smollm2-135m"
FULL = {"single_prompt_len": 256, "min_prompt_len": 69, "max_prompt_len": 357, "num_requests": 16,
        "beam_width": 4, "max_new_tokens": 64, "repeats": 3}  # fmt: skip
QUICK = {"single_prompt_len": 40, "min_prompt_len": 9, "max_prompt_len": 57, "num_requests": 4,
         "beam_width": 4, "max_new_tokens": 6, "repeats": 1}  # fmt: skip
SEED = 29
FIRST_TOKEN_ID = 100  # clear of special tokens
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0
SYSTEM_TIMEOUT_S = 3600.0
KV_CACHE_GIB = 1.0
SYSTEMS = ("transformers", "openvino", "ctranslate2", "beamsplit-aggregated", "beamsplit-disaggregated")


def _say(message: str) -> None:
    print(f"[bench peers] {message}", file=sys.stderr, flush=True)


def make_workload(settings: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    rng = random.Random(SEED)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(length)]

    lengths = [
        rng.randint(settings["min_prompt_len"], settings["max_prompt_len"])
        for _ in range(settings["num_requests"])
    ]
    workload: dict[str, Any] = {
        "single": prompt(settings["single_prompt_len"]),
        "batch": [prompt(length) for length in lengths],
        "repeats": settings["repeats"],
        "beam_width": settings["beam_width"],
        "max_new_tokens": settings["max_new_tokens"],
    }
    # Each warm single request (and the streamed one) gets a prompt of its own of the same length:
    # a repeated prompt would be served from beamsplit's prefix cache (224 of 256 tokens reused),
    # which measures the cache, not a warm engine against a cold one.
    workload["warm_singles"] = [prompt(settings["single_prompt_len"]) for _ in range(settings["repeats"])]
    workload["stream"] = prompt(settings["single_prompt_len"])
    # The batch runs once a round, `repeats` rounds, and its median wall time gives the throughput
    # (one run on a shared host drifts by a tenth between minutes); each run's prompts are its own,
    # of the same lengths, for the prefix cache's reason above. Drawn last: the prompts above stay
    # as they were.
    workload["batches"] = [workload["batch"]] + [
        [prompt(length) for length in lengths] for _ in range(settings["repeats"] - 1)
    ]
    return workload


def round_workload(workload: dict[str, Any], index: int) -> dict[str, Any]:
    """Round `index`'s part of the workload: the cold request and the streamed one as every round's
    (each round starts every system afresh), its own warm single request and its own batch."""
    return {
        **workload,
        "warm_singles": [workload["warm_singles"][index]],
        "batches": [workload["batches"][index]],
        "repeats": 1,
    }


# ---- beamsplit through its HTTP front --------------------------------------------------------------
def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _completion(base_url: str, prompt: list[int], workload: dict[str, Any]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": workload["max_new_tokens"], "use_beam_search": True,
            "best_of": workload["beam_width"], "n": 1, "temperature": 0, "ignore_eos": True}  # fmt: skip
    token_ids: list[int] = _post(f"{base_url}/completions", body)["choices"][0]["token_ids"]
    return token_ids


def _streamed_greedy(base_url: str, prompt: list[int], max_new_tokens: int) -> tuple[float, float]:
    """(TTFT, mean gap between later events) of a streamed greedy request, in seconds."""
    import urllib.request

    body = {
        "prompt": prompt,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{base_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    times = []
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                times.append(time.monotonic() - started)
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    return times[0], (statistics.mean(gaps) if gaps else 0.0)


def _wait_http(base_url: str, timeout_s: float) -> None:
    """The HTTP front answers /models (it starts after the gRPC health check passes)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + max(timeout_s, 1.0)
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/models", timeout=5.0):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url} did not answer within {timeout_s:.0f} s") from None
            time.sleep(0.2)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_beamsplit(
    deployment: str,
    model: str,
    precision: str,
    threads: int,
    workload: dict[str, Any],
    log_dir: Path,
    page_bytes: int,
) -> dict[str, Any]:
    """One deployment started alone (its processes load the model), warmed by nothing but its own
    start-up, then the same workload as the peers; stopped by pid in `finally`."""
    from beamsplit.launch.launcher import ProcessGroup

    group = ProcessGroup(log_dir / f"{deployment}-{precision}")
    engine = [
        "--model",
        model,
        "--dtype",
        precision,
        "--tokens-per-block",
        "32",
        "--kv-cache-gib",
        str(KV_CACHE_GIB),
    ]
    env = {"OMP_NUM_THREADS": str(threads)}
    report: dict[str, Any] = {}
    try:
        started = time.monotonic()
        if deployment == "aggregated":
            front = group.start("aggregated", "aggregated", engine, env=env, http=True)
            engines = [front]
        else:
            context = group.start("context", "context", engine, env=env)
            generation = group.start("generation", "generation", engine, env=env)
            front = group.start("coordinator", "coordinator",
                                ["--context", context.address, "--generation", generation.address], http=True)  # fmt: skip
            engines = [context, generation]
        for server in [*engines, front]:
            group.wait_healthy(server, STARTUP_TIMEOUT_S)
        _wait_http(front.http_url, STARTUP_TIMEOUT_S - (time.monotonic() - started))
        report["startup_s"] = time.monotonic() - started
        report["rss_after_load_bytes"] = sum(_rss_bytes(server.pid) for server in engines)
        report["num_engine_processes"] = len(engines)  # each holds the weights
        base_url = front.http_url
        started = time.monotonic()
        _completion(base_url, workload["single"], workload)
        report["first_s"] = time.monotonic() - started
        report["single_s"] = []
        for prompt in workload["warm_singles"]:
            started = time.monotonic()
            _completion(base_url, prompt, workload)
            report["single_s"].append(time.monotonic() - started)
        report["batch_runs_s"] = []
        for batch in workload["batches"]:
            started = time.monotonic()
            with ThreadPoolExecutor(len(batch)) as pool:
                futures = [pool.submit(_completion, base_url, prompt, workload) for prompt in batch]
                top_beams = [future.result() for future in futures]
            report["batch_runs_s"].append(time.monotonic() - started)
            report.setdefault("batch_top_beams", top_beams)  # the first batch's, compared with transformers'
        report["batch_s"] = statistics.median(report["batch_runs_s"])
        report["ttft_s"], report["itl_s"] = _streamed_greedy(
            base_url, workload["stream"], workload["max_new_tokens"]
        )
        report["rss_bytes"] = sum(_rss_bytes(server.pid) for server in engines)
        blocks = [server.metric("beamsplit_kv_blocks_capacity") or 0.0 for server in engines]
        report["kv_pool_bytes"] = int(sum(blocks)) * page_bytes or None
    finally:
        group.stop_all()
    return report


# ---- the peers, each in a process of its own -------------------------------------------------------
def run_peer(
    system: str, python: Path, model_dir: Path, precision: str, threads: int, workload_file: Path
) -> dict[str, Any]:
    command = [
        str(python),
        str(SYSTEMS_SCRIPT),
        system,
        str(model_dir),
        precision,
        str(threads),
        str(workload_file),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=SYSTEM_TIMEOUT_S, env=env)
    if result.returncode != 0:
        return {
            "error": failure_reason(result.returncode, result.stderr),
            "stderr_tail": result.stderr[-2000:],
        }
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    report["rss_bytes"] = report["peak_rss_bytes"]
    return report


def failure_reason(returncode: int, stderr: str) -> str:
    """Why a system's process failed, in one line: its last line of stderr (an uncaught exception's
    type and message), not the traceback above it."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return f"exit {returncode}: {lines[-1][:300] if lines else 'no output on stderr'}"


def model_description(model_dir: Path) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config["intermediate_size"]
    linear = layers * per_layer + vocab * hidden  # the LM head's product, tied or not
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return {
        "directory": str(model_dir),
        "linear_parameters": linear,
        "parameters": layers * per_layer + embeddings,
        "kv_bytes_per_token_f32": layers * 2 * kv_heads * head_dim * 4,
    }


def run_benchmark(arguments: argparse.Namespace) -> dict[str, Any]:
    settings = QUICK if arguments.quick else FULL
    threads = arguments.threads or len(os.sched_getaffinity(0))
    cache_dir = Path(arguments.cache_dir) if arguments.cache_dir else setup.CACHE_DIR
    flags = rules.cpu_flags(Path("/proc/cpuinfo").read_text())
    precision_names, bf16_reason = rules.precisions(flags)
    if arguments.quick and len(precision_names) > 1:
        precision_names, bf16_reason = ["float32"], f"bfloat16 skipped in --quick ({bf16_reason})"
    report: dict[str, Any] = {
        "settings": settings,
        "threads": threads,
        "cpu_flags": flags,
        "bf16": bf16_reason,
    }
    _say(f"host: {threads} threads, flags {' '.join(flags) or '-'}; {bf16_reason}")
    _say("phase 1/4: host limits (a large GEMM per precision, copy bandwidth)")
    report["host_limits"] = limits = rules.measure_host_limits(precision_names, threads, arguments.quick)
    _say("phase 2/4: checkpoints and the peers' venv (built once into bench/out/peers-cache)")
    if arguments.quick:
        model_dir = serve_model.ensure_checkpoint(serve_model.PRESETS["llama-small"])
        model_name = "llama-small"
    else:
        from engine.models.source import resolve_model_source

        gguf = resolve_model_source(MODEL).path
        assert gguf is not None
        model_dir = setup.hf_checkpoint(gguf, MODEL, _say, cache_dir)
        model_name = MODEL
    peer_python, venv_status = setup.peer_venv(_say, not arguments.quick, cache_dir)
    report["peer_venv"] = venv_status
    model = model_description(model_dir)
    model["single_prompt_tokens"] = settings["single_prompt_len"]
    report["model"] = model
    config = json.loads((model_dir / "config.json").read_text())
    workload = make_workload(settings, config["vocab_size"])
    logs = Path(tempfile.mkdtemp(prefix="beamsplit-bench-peers-"))
    (logs / "workload.json").write_text(json.dumps(workload))
    report["logs"] = str(logs)
    peer_dirs: dict[str, Path | None] = {"transformers": model_dir, "openvino": None, "ctranslate2": None}
    peer_errors: dict[str, str] = {}
    for kind in ("openvino", "ctranslate2"):
        if peer_python is None:
            peer_errors[kind] = venv_status
            continue
        try:
            peer_dirs[kind] = setup.converted(kind, model_dir, model_name, peer_python, _say, cache_dir)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            peer_errors[kind] = str(error)
    # Every system once a round, the rounds one after the other: a drift of the shared host between
    # minutes (a batch's time moved by a tenth) then falls on every system and precision alike,
    # where running each system's repeats back to back gave it to whichever ran in that minute.
    num_rounds = settings["repeats"]
    raws: dict[str, dict[str, list[dict[str, Any]]]] = {
        precision: {system: [] for system in SYSTEMS} for precision in precision_names
    }
    _say(
        f"phase 3/4: the systems one after the other, {num_rounds} round(s) (workload and server logs in {logs})"
    )

    def run_once(
        system: str, precision: str, index: int, part: dict[str, Any], round_file: Path
    ) -> dict[str, Any]:
        """One round of one system on the round's workload (`part`, written to `round_file` for the
        peers): its raw timings, or {"error": why}."""
        if system.startswith("beamsplit-"):
            page_bytes = model["kv_bytes_per_token_f32"] * 32 // (2 if precision == "bfloat16" else 1)
            try:
                return run_beamsplit(system.split("-")[1], str(model_dir), precision, threads, part,
                                     logs / f"round-{index + 1}", page_bytes)  # fmt: skip
            except (RuntimeError, OSError) as error:
                return {"error": str(error)[-300:]}
        directory = peer_dirs[system]
        if directory is None:
            return {"error": peer_errors[system]}
        python = Path(sys.executable) if system == "transformers" else peer_python
        assert python is not None
        return run_peer(system, python, directory, precision, threads, round_file)

    tokens = len(workload["batch"]) * workload["beam_width"] * workload["max_new_tokens"]
    for index in range(num_rounds):
        part = round_workload(workload, index)
        round_file = logs / f"workload-round-{index + 1}.json"
        round_file.write_text(json.dumps(part))
        for precision in precision_names:
            for system in SYSTEMS:
                done = raws[precision][system]
                if done and "error" in done[-1]:
                    continue  # failed in an earlier round: not tried again
                started = time.monotonic()
                raw = run_once(system, precision, index, part, round_file)
                done.append(raw)
                where = f"round {index + 1}/{num_rounds}: {system} {precision}"
                if "error" in raw:
                    _say(f"{where}: skipped ({raw['error'][:200]})")
                else:
                    _say(f"{where}: alone {statistics.median(raw['single_s']):.2f} s, "
                         f"{tokens / raw['batch_s']:.1f} beam tokens/s ({time.monotonic() - started:.0f} s)")  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    reference: list[list[int]] | None = None
    for precision in precision_names:
        systems: dict[str, Any] = results.setdefault(precision, {})
        for system in SYSTEMS:
            raw = rules.merge_rounds(raws[precision][system])
            if "error" in raw:
                systems[system] = raw
                continue
            figures = rules.system_figures(
                raw, len(workload["batch"]), workload["max_new_tokens"], workload["beam_width"]
            )
            if system == "transformers" and precision == "float32":
                reference = figures["batch_top_beams"]
            figures["agreement"] = rules.agreement(figures.pop("batch_top_beams"), reference)
            figures["num_requests"] = len(workload["batch"])
            rules.host_fractions(figures, limits, precision, model)
            if figures.get("kv_pool_bytes"):
                weight_bytes = (
                    model["parameters"]
                    * (2 if precision == "bfloat16" else 4)
                    * figures["num_engine_processes"]
                )
                figures["rss_over_weights_and_pool"] = figures["rss_after_load_bytes"] / (
                    weight_bytes + figures["kv_pool_bytes"]
                )
            systems[system] = figures
    _say("phase 4/4: ratios, goals, plot")
    rules.add_ratios(results)
    report["results"] = results
    report["goals"] = rules.build_goals(results, precision_names, len(precision_names) > 1)
    report["table"] = rules.table(results)
    plot = rules.plot(results, OUT_DIR / "peers.png")
    report["plots"] = [str(plot)] if plot else []
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny random model, short requests, no peer install"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="threads for every system (default: the usable cores)"
    )


def run(arguments: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    report = run_benchmark(arguments)
    print(json.dumps(report, indent=None if arguments.json else 1))
    if not arguments.json:
        print(report["table"], file=sys.stderr)
    for goal in report["goals"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        _say(f"goal {goal['goal']}: {goal['measured']} ({goal['direction']} {goal['bound']}) {verdict}")
    ours = [figures for systems in report["results"].values() for name, figures in systems.items()
            if name.startswith("beamsplit-")]  # fmt: skip
    return 1 if any("error" in figures for figures in ours) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
