"""Runs `deploy/two_gpu.sh` on free ports and checks it the way a user would use it.

`check_parity_and_clean_stop` is the smoke test shared by the CPU run (tests/integration) and the
GPU run (tests/gpu): requests through the coordinator equal the aggregated reference's beams
exactly, every worker's `beamsplit_kv_blocks_in_use` reads 0, and SIGINT (what Ctrl-C sends)
stops every server by pid with exit 0 and 0 blocks in use at exit.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from beamsplit.client.grpc_client import BeamsplitClient, GenerateResult, build_request
from beamsplit.launch.launcher import PortPicker
from beamsplit.server.metrics import read_gauge
from beamsplit.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "two_gpu.sh"
HOST = "127.0.0.1"
MAX_NEW_TOKENS = 8


@dataclass
class Deployment:
    script: subprocess.Popen[bytes]
    output_path: Path
    ports: dict[str, int]
    metrics_ports: dict[str, int]
    log_dir: Path

    def output(self) -> list[str]:
        return self.output_path.read_text().splitlines()

    def pids(self) -> dict[str, int]:
        for line in self.output():
            if "pids " in line:
                return {name: int(pid) for name, pid in re.findall(r"(\w+)=(\d+)", line)}
        return {}

    def blocks_in_use(self) -> dict[str, float | None]:
        blocks: dict[str, float | None] = {}
        for name in ("context", "generation", "aggregated"):
            url = f"http://{HOST}:{self.metrics_ports[name]}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                blocks[name] = read_gauge(response.read().decode(), "beamsplit_kv_blocks_in_use")
        return blocks


def script_env(ports: PortPicker, log_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DEVICE="cpu",
        BEAMSPLIT=f"{sys.executable} -m beamsplit.cli",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        LOG_DIR=str(log_dir),
        COORDINATOR_PORT=str(ports.pick()),
        CONTEXT_PORT=str(ports.pick()),
        GENERATION_PORT=str(ports.pick()),
        AGGREGATED_PORT=str(ports.pick()),
        READY_TIMEOUT_S="150",
        STOP_TIMEOUT_S="30",
        NUM_BLOCKS="256",
        HTTP_PORT=str(ports.pick()),
    )
    env.update(extra)
    return env


def read_until(deployment: Deployment, marker: str, timeout_s: float) -> bool:
    """Waits until a line of the script's output holds `marker` (False: the script exited first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(marker in line for line in deployment.output()):
            return True
        if deployment.script.poll() is not None:
            return any(marker in line for line in deployment.output())
        time.sleep(0.1)
    raise AssertionError(f"no line with {marker!r} within {timeout_s}s; so far: {deployment.output()}")


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(deployment: Deployment) -> None:
    """Whatever happened: the script gets SIGTERM, and any server still alive gets SIGKILL by pid."""
    pids = deployment.pids()
    if deployment.script.poll() is None:
        deployment.script.send_signal(signal.SIGTERM)
        try:
            deployment.script.wait(timeout=60)
        except subprocess.TimeoutExpired:
            deployment.script.kill()
            deployment.script.wait(timeout=10)
    for pid in pids.values():
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running_script(tmp_path: Path, dtype: str = "float32", **extra_env: str) -> Iterator[Deployment]:
    """The script on free ports with an aggregated reference; stopped by pid whatever happens."""
    ports = PortPicker(HOST)
    metrics_base = ports.pick()
    while not all(_is_free(metrics_base + offset) for offset in range(4)):
        metrics_base = ports.pick()
    env = script_env(ports, tmp_path, METRICS_BASE_PORT=str(metrics_base), **extra_env)
    output_path = tmp_path / "two_gpu.out"
    with output_path.open("wb") as output:
        script = subprocess.Popen(
            ["bash", str(SCRIPT), "tiny", dtype],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            # As from a terminal: a shell cannot trap a signal ignored on entry, and a test run
            # started in the background by a non-interactive shell (`cmd &`) ignores SIGINT.
            preexec_fn=_default_sigint,
        )
    started = Deployment(
        script=script,
        output_path=output_path,
        ports={name: int(env[f"{name.upper()}_PORT"]) for name in ("coordinator", "aggregated", "http")},
        metrics_ports={
            name: metrics_base + offset
            for offset, name in enumerate(("coordinator", "context", "generation", "aggregated"))
        },
        log_dir=tmp_path,
    )
    try:
        yield started
    finally:
        stop(started)


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def prompt_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


def assert_parity(result: GenerateResult, reference: GenerateResult, beam_width: int) -> None:
    assert len(result.beams) == len(reference.beams) == beam_width
    for index, (beam, expected) in enumerate(zip(result.beams, reference.beams, strict=True)):
        assert beam.token_ids == expected.token_ids, f"beam {index} tokens differ"
        assert beam.finish_reason == expected.finish_reason
        assert beam.score == expected.score, f"beam {index} score"


def _sampling(beam_width: int) -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(beam_width=beam_width, max_new_tokens=MAX_NEW_TOKENS)


def check_parity_and_clean_stop(deployment: Deployment) -> None:
    assert read_until(deployment, "Ctrl-C stops all", 180.0), (
        "the script exited before serving:\n" + "\n".join(deployment.output())
    )
    coordinator_port = deployment.ports["coordinator"]
    assert f"send requests to the coordinator at {HOST}:{coordinator_port}" in deployment.output()[0]
    pids = deployment.pids()
    assert set(pids) == {"context", "generation", "coordinator", "aggregated"}
    # The HTTP front is open, and every engine says the pool it chose (NUM_BLOCKS=256 here).
    http = f"http://{HOST}:{deployment.ports['http']}"
    assert f"HTTP front        {http}/v1" in "\n".join(deployment.output())
    with urllib.request.urlopen(f"{http}/health", timeout=10.0) as health:
        assert health.status == 200
    for name in ("context", "generation", "aggregated"):
        assert any(line.startswith(f"  {name}: KV pool 256 blocks x ") for line in deployment.output()), name

    requests = [
        build_request(token_ids=prompt_tokens(67, seed=1), sampling=_sampling(1)),
        build_request(token_ids=prompt_tokens(67, seed=1), sampling=_sampling(4)),  # reuses 64 tokens
        build_request(prompt="the two GPU layout", sampling=_sampling(2)),
    ]
    with (
        BeamsplitClient(f"{HOST}:{coordinator_port}") as coordinator,
        BeamsplitClient(f"{HOST}:{deployment.ports['aggregated']}") as aggregated,
    ):
        results = []
        for request in requests:
            result = coordinator.generate(request, timeout_s=120.0)
            reference = aggregated.generate(request, timeout_s=120.0)
            assert_parity(result, reference, request.sampling.beam_width)
            assert result.texts == reference.texts
            results.append(result)
    assert [result.stats["transferred_blocks"] for result in results[:2]] == [3, 1]  # block 32
    assert results[1].stats["context_reused_tokens"] == results[1].stats["generation_reused_tokens"] == 64
    deadline = time.monotonic() + 10.0
    blocks = deployment.blocks_in_use()
    while any(value != 0 for value in blocks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        blocks = deployment.blocks_in_use()
    assert blocks == {"context": 0, "generation": 0, "aggregated": 0}
    with urllib.request.urlopen(f"{http}/metrics", timeout=10.0) as page:  # the coordinator's registry
        assert 'beamsplit_requests_total{outcome="ok"} 3.0' in page.read().decode()

    deployment.script.send_signal(signal.SIGINT)  # what Ctrl-C sends the script
    try:
        code = deployment.script.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"the script did not stop within 90 s of SIGINT\n{_state(deployment, pids)}"
        ) from None
    assert code == 0, "\n".join(deployment.output())
    output = deployment.output()
    for name in ("context", "generation", "aggregated"):
        assert f"{name}: exit 0, blocks in use at exit: 0" in output
    assert "coordinator: exit 0" in output
    assert not [name for name, pid in pids.items() if is_alive(pid)]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _state(deployment: Deployment, pids: dict[str, int]) -> str:
    """What a stop that hangs leaves to read: the script's output, who still runs, the log tails."""
    lines = ["script output:", *deployment.output()]
    lines.append(f"still running: {[name for name, pid in pids.items() if is_alive(pid)]}")
    for log in sorted(deployment.log_dir.glob("*.log")):
        lines += [f"--- {log.name} (last 15 lines)", *log.read_text(errors="replace").splitlines()[-15:]]
    return "\n".join(lines)
