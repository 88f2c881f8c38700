"""Soak benchmark: mixed traffic for N minutes while one worker is SIGKILLed and restarted every minute.

    beamsplit bench soak [--json] [--minutes 10] [--concurrency 16]     (or: python bench/soak.py ...)

Deployment on loopback (`tiny`, float32, block 32): two context workers, two generation workers,
one coordinator. Traffic: `--concurrency` client threads, each sending one streaming request after
another (beam widths 1/2/4, prompts of 8-200 tokens, half sharing a prefix, 8 new tokens, a 60 s
deadline). Every minute one worker (context and generation in turn) is killed with SIGKILL and
started again on the same ports; the coordinator routes around it meanwhile.

Each request is accounted once: `served` (one final result), `refused` (a clean status: the
coordinator could not serve it, e.g. UNAVAILABLE while a worker was down mid-stream, or
RESOURCE_EXHAUSTED), `lost` (no final and no error, a second final, or a status that means a
hang or a bug: DEADLINE_EXCEEDED, INTERNAL, UNKNOWN). After the traffic stops, every worker's
`beamsplit_kv_blocks_in_use` must return to 0 within 30 s (`stranded_blocks` is what is left).
Every 5 s the RSS of each process is sampled: `rss_mib` gives first/last/max per process since its
last start (the coordinator is never restarted, so its line is the leak check). Goal: 0 lost,
0 stranded, memory flat. Prints JSON; draws bench/out/soak.png.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"
ENGINE = ["--model", "tiny", "--dtype", "float32", "--tokens-per-block", "32"]
REQUEST_TIMEOUT_S = 60.0
SAMPLE_EVERY_S = 5.0
KILL_EVERY_S = 60.0
STARTUP_TIMEOUT_S = 180.0
LOST_CODES = ("lost", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN")


def _say(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def classify(outcomes: list[str]) -> dict[str, Any]:
    """served / refused (by status) / lost, from the outcome names of `load_driver`."""
    counts = collections.Counter(outcomes)
    refused = {code: count for code, count in counts.items() if code != "ok" and code not in LOST_CODES}
    lost = {code: count for code, count in counts.items() if code in LOST_CODES}
    return {
        "requests": len(outcomes),
        "served": counts.get("ok", 0),
        "refused": sum(refused.values()),
        "refused_by_status": refused,
        "lost": sum(lost.values()),
        "lost_by_kind": lost,
    }


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Deployment:
    """2 context + 2 generation workers and a coordinator; a worker can be restarted on its ports."""

    def __init__(self, log_dir: Path) -> None:
        from beamsplit.launch.launcher import HOST, PortPicker

        self._log_dir = log_dir
        self._ports = PortPicker()
        self.host = HOST
        self.commands: dict[str, list[str]] = {}
        self.ports: dict[str, tuple[int, int]] = {}
        self.processes: dict[str, Any] = {}
        self.started_at: dict[str, float] = {}
        workers = {"context-0": "context", "context-1": "context", "generation-0": "generation",
                   "generation-1": "generation"}  # fmt: skip
        for name, role in workers.items():
            self._define(name, role, ENGINE)
        contexts = ",".join(self.address(name) for name in workers if name.startswith("context"))
        generations = ",".join(self.address(name) for name in workers if name.startswith("generation"))
        self._define("coordinator", "coordinator", ["--context", contexts, "--generation", generations])

    def _define(self, name: str, role: str, arguments: list[str]) -> None:
        port, metrics_port = self._ports.pick(), self._ports.pick()
        self.ports[name] = (port, metrics_port)
        self.commands[name] = [
            sys.executable, "-m", "beamsplit.cli", "serve", role, "--host", self.host, "--port", str(port),
            "--metrics-port", str(metrics_port), *arguments,
        ]  # fmt: skip

    def address(self, name: str) -> str:
        return f"{self.host}:{self.ports[name][0]}"

    def start(self, name: str) -> None:
        with open(self._log_dir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                self.commands[name], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at[name] = time.monotonic()

    def wait_healthy(self, name: str, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        from beamsplit.server.server_common import wait_until_healthy

        started = time.monotonic()
        process = self.processes[name]
        if not wait_until_healthy(self.address(name), timeout_s, is_alive=lambda: process.poll() is None):
            raise RuntimeError(f"{name} not healthy; log in {self._log_dir / f'{name}.log'}")
        return time.monotonic() - started

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.kill()  # SIGKILL: no drain, no cleanup, no notice to anyone
        process.wait(timeout=10.0)

    def blocks_in_use(self, name: str) -> float | None:
        from beamsplit.server.metrics import read_gauge

        url = f"http://{self.host}:{self.ports[name][1]}/metrics"
        try:
            import urllib.request

            with urllib.request.urlopen(url, timeout=5.0) as page:
                return read_gauge(page.read().decode(), "beamsplit_kv_blocks_in_use")
        except OSError:
            return None

    def stop_all(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(timeout=20.0)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait(timeout=10.0)
        return codes


def run_soak(minutes: float, concurrency: int) -> dict[str, Any]:
    import grpc

    from beamsplit.client.load_driver import mixed_specs, run_stream
    from beamsplit.v1 import coordinator_pb2_grpc

    log_dir = Path(tempfile.mkdtemp(prefix="beamsplit-bench-soak-"))
    _say(f"server logs in {log_dir}")
    deployment = Deployment(log_dir)
    outcomes: list[tuple[float, str]] = []
    samples: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    try:
        for name in deployment.commands:
            deployment.start(name)
        for name in deployment.commands:
            deployment.wait_healthy(name)
        _say("deployment healthy; traffic starts")
        began = time.monotonic()

        def client(index: int) -> None:
            specs = itertools.cycle(mixed_specs(200, seed=index))
            with grpc.insecure_channel(deployment.address("coordinator")) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                for spec in specs:
                    if stop.is_set():
                        return
                    outcome = run_stream(stub, spec, REQUEST_TIMEOUT_S)
                    with lock:
                        outcomes.append((time.monotonic() - began, outcome.outcome))

        threads = [
            threading.Thread(target=client, args=(index,), daemon=True) for index in range(concurrency)
        ]
        for thread in threads:
            thread.start()
        victims = ["generation-0", "context-0", "generation-1", "context-1"]
        end = began + minutes * 60.0
        next_kill, next_sample = began + KILL_EVERY_S, began
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                next_sample += SAMPLE_EVERY_S
                samples.append({"t": round(now - began, 1), **_sample(deployment)})
            if now >= next_kill and now + 10.0 < end:
                next_kill += KILL_EVERY_S
                victim = victims[len(kills) % len(victims)]
                deployment.kill(victim)
                deployment.start(victim)
                restart_s = deployment.wait_healthy(victim)
                kills.append(
                    {"t": round(now - began, 1), "worker": victim, "healthy_again_s": round(restart_s, 1)}
                )
                _say(f"killed and restarted {victim}: healthy again after {restart_s:.1f} s")
            time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(REQUEST_TIMEOUT_S + 10.0)
        stranded = _wait_for_empty_pools(deployment, timeout_s=30.0)
        samples.append({"t": round(time.monotonic() - began, 1), **_sample(deployment)})
    finally:
        stop.set()
        codes = deployment.stop_all()
        _say(f"stopped, exit codes {codes}")
    result = {
        "minutes": minutes,
        "concurrency": concurrency,
        **classify([outcome for _, outcome in outcomes]),
        "kills": kills,
        "stranded_blocks": stranded,
        "rss_mib": _rss_summary(samples, kills),
    }
    result["ok"] = result["lost"] == 0 and not any(stranded.values())
    result["samples"] = samples
    result["served_per_10s"] = _per_bucket([t for t, outcome in outcomes if outcome == "ok"], 10.0)
    return result


def _sample(deployment: Deployment) -> dict[str, Any]:
    rss = {name: rss_mib(process.pid) for name, process in deployment.processes.items()}
    blocks = {name: deployment.blocks_in_use(name) for name in deployment.processes if name != "coordinator"}
    return {"rss_mib": rss, "blocks_in_use": blocks}


def _wait_for_empty_pools(deployment: Deployment, timeout_s: float) -> dict[str, float | None]:
    names = [name for name in deployment.processes if name != "coordinator"]
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = {name: deployment.blocks_in_use(name) for name in names}
        if not any(blocks.values()) or time.monotonic() > deadline:
            return blocks


def _rss_summary(samples: list[dict[str, Any]], kills: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process, over the samples since its last restart."""
    summary: dict[str, dict[str, float]] = {}
    for name in samples[0]["rss_mib"] if samples else []:
        since = max([kill["t"] for kill in kills if kill["worker"] == name], default=-1.0)
        values = [
            sample["rss_mib"][name] for sample in samples if sample["t"] > since and sample["rss_mib"][name]
        ]
        if values:
            summary[name] = {
                "first": round(values[0], 1),
                "last": round(values[-1], 1),
                "max": round(max(values), 1),
            }
    return summary


def _per_bucket(times: list[float], bucket_s: float) -> list[int]:
    counts = collections.Counter(int(t // bucket_s) for t in times)
    return [counts.get(index, 0) for index in range(max(counts, default=-1) + 1)]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    samples = result["samples"]
    for name in samples[0]["rss_mib"] if samples else []:
        top.plot([s["t"] for s in samples], [s["rss_mib"][name] for s in samples], marker=".", label=name)
    buckets = result["served_per_10s"]
    bottom.bar(
        [10.0 * index + 5.0 for index in range(len(buckets))], buckets, width=9.0, label="served per 10 s"
    )
    for kill in result["kills"]:
        for axes in (top, bottom):
            axes.axvline(kill["t"], color="red", linestyle=":", linewidth=1)
        top.annotate(
            f"kill {kill['worker']}", (kill["t"], top.get_ylim()[1]), fontsize=7, rotation=90, va="top"
        )
    top.set_ylabel("RSS MiB")
    top.set_title(
        f"soak {result['minutes']:g} min: served {result['served']}, refused {result['refused']}, "
        f"lost {result['lost']}, stranded {sum(v or 0 for v in result['stranded_blocks'].values()):g}"
    )
    top.legend(fontsize=8)
    bottom.set_ylabel("requests")
    bottom.set_xlabel("seconds")
    bottom.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs")
    parser.add_argument(
        "--concurrency", type=int, default=16, help="client threads, one request in flight each"
    )


def run(arguments: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    result = run_soak(arguments.minutes, arguments.concurrency)
    plot_path = OUT_DIR / "soak.png"
    plot(result, plot_path)
    shown = {key: value for key, value in result.items() if key != "samples"}
    print(json.dumps(shown, indent=None if arguments.json else 1))
    _say(f"plot: {plot_path}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
