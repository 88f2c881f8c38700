"""Two Linux network namespaces joined by a veth pair, for cross-host tests on one machine.

`NetnsPair.create()` makes namespaces `bsx<pid>a` and `bsx<pid>b` (unique per test process), a
veth pair between them with 10.231.7.1/30 in A and 10.231.7.2/30 in B, and brings up both ends and
both loopbacks. Nothing is added to the root namespace. `destroy()` deletes both namespaces (which
deletes the veth pair). It raises `NetnsUnavailable` with the reason when the host does not allow
it (not root, no `ip`, no CAP_SYS_ADMIN in a container), so a test can skip with that reason.

Processes run inside a namespace with `ip netns exec NAME ...`, which execs the command in place:
the pid of the `Popen` is the server's own pid, so it is stopped by pid like any other.

The test process stays in the root namespace. It talks to the servers through a `Bridge`: this
module run as `python -m tests.netns_helpers bridge` inside a namespace, answering one JSON request
per line on stdin with one JSON reply per line on stdout (generate, health, metrics, connect).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beamsplit.launch.launcher import stop_processes

ADDRESS_A = "10.231.7.1"
ADDRESS_B = "10.231.7.2"
PREFIX_LEN = 30
_NAME_PREFIX = "bsx"
_REPO_ROOT = Path(__file__).resolve().parents[1]


class NetnsUnavailable(RuntimeError):
    """This host does not let us create network namespaces; the message says why."""


def _ip(*arguments: str, check: bool = True, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=timeout_s)
    if check and completed.returncode != 0:
        raise RuntimeError(
            f"ip {' '.join(arguments)} failed ({completed.returncode}): {completed.stderr.strip()}"
        )
    return completed


def _delete_stale_namespaces() -> None:
    """Namespaces of ours whose test process is gone (it was SIGKILLed before its teardown)."""
    listing = _ip("netns", "list", check=False)
    for line in listing.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        digits = name[len(_NAME_PREFIX) : -1]
        if name.startswith(_NAME_PREFIX) and name[-1:] in ("a", "b") and digits.isdigit():
            if not Path(f"/proc/{digits}").exists():
                # Servers that outlived that run would keep the namespace alive: they are ours.
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", name, check=False)


@dataclass
class NetnsPair:
    ns_a: str
    ns_b: str
    veth_a: str
    veth_b: str
    address_a: str = ADDRESS_A
    address_b: str = ADDRESS_B

    @classmethod
    def create(cls) -> NetnsPair:
        if sys.platform != "linux":
            raise NetnsUnavailable(f"network namespaces are Linux only (platform {sys.platform})")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("`ip` (iproute2) is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"creating network namespaces needs root (euid {os.geteuid()})")
        _delete_stale_namespaces()
        tag = f"{_NAME_PREFIX}{os.getpid()}"
        pair = cls(ns_a=f"{tag}a", ns_b=f"{tag}b", veth_a=f"{tag}va", veth_b=f"{tag}vb")
        try:
            pair._build()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            pair.destroy()
            raise NetnsUnavailable(f"cannot create network namespaces here: {error}") from error
        return pair

    def _build(self) -> None:
        _ip("netns", "add", self.ns_a)
        _ip("netns", "add", self.ns_b)
        # Created inside A, so the pair never exists in the root namespace under our names.
        _ip(
            "-n",
            self.ns_a,
            "link",
            "add",
            self.veth_a,
            "type",
            "veth",
            "peer",
            "name",
            self.veth_b,
            "netns",
            self.ns_b,
        )
        for namespace, device, address in (
            (self.ns_a, self.veth_a, self.address_a),
            (self.ns_b, self.veth_b, self.address_b),
        ):
            _ip("-n", namespace, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", device)
            _ip("-n", namespace, "link", "set", device, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def destroy(self) -> None:
        """Idempotent; deleting a namespace deletes the veth end inside it, and so the pair."""
        for namespace in (self.ns_a, self.ns_b):
            _ip("netns", "del", namespace, check=False)

    def exists(self) -> bool:
        names = {
            line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.split()
        }
        return self.ns_a in names or self.ns_b in names

    def tx_bytes(self, namespace: str, device: str) -> int:
        """Bytes sent by `device` inside `namespace` (the kernel's 64-bit counter)."""
        shown = json.loads(_ip("-n", namespace, "-j", "-s", "link", "show", "dev", device).stdout)
        return int(shown[0]["stats64"]["tx"]["bytes"])


def exec_argv(namespace: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


@dataclass
class NsProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-num_lines:])


@dataclass
class NsProcessGroup:
    """Servers started in namespaces, stopped together by pid (SIGTERM, SIGKILL after a bound)."""

    log_dir: Path
    processes: list[NsProcess] = field(default_factory=list)

    def start(
        self, name: str, namespace: str, argv: list[str], env: dict[str, str] | None = None
    ) -> NsProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                exec_argv(namespace, argv),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=_REPO_ROOT,
                start_new_session=True,
            )
        started = NsProcess(name, process, log_path)
        self.processes.append(started)
        return started

    def stop_all(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        return stop_processes(self.processes, timeout_s)


def listening_tcp_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every IPv4/IPv6 TCP socket in LISTEN state in the network namespace of `pid`."""
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(address_hex)
            if table == "tcp":
                address = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                words = b"".join(raw[index : index + 4][::-1] for index in range(0, 16, 4))
                address = socket.inet_ntop(socket.AF_INET6, words)
                if address.startswith("::ffff:") and "." in address:  # an IPv4-mapped bind
                    address = address.removeprefix("::ffff:")
            found.append((address, int(port_hex, 16)))
    return found


class BridgeError(RuntimeError):
    pass


class Bridge:
    """A `python -m tests.netns_helpers bridge` process inside `namespace`, one request at a time."""

    def __init__(self, namespace: str, log_path: Path) -> None:
        self._stderr = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            exec_argv(namespace, [sys.executable, "-m", "tests.netns_helpers", "bridge"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=_REPO_ROOT,
            start_new_session=True,
        )
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._replies.put(line)
        self._replies.put(b"")

    def call(self, op: str, *, wait_s: float = 120.0, **arguments: Any) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **arguments}).encode() + b"\n")
        self.process.stdin.flush()
        try:
            line = self._replies.get(timeout=wait_s)
        except queue.Empty:
            raise BridgeError(f"bridge: no reply to {op} within {wait_s} s") from None
        if not line:
            raise BridgeError(f"bridge exited ({self.process.poll()}) during {op}")
        reply = json.loads(line)
        if "bridge_error" in reply:
            raise BridgeError(f"bridge: {op} raised {reply['bridge_error']}")
        return reply["result"]

    def close(self) -> None:
        if self.process.poll() is None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5.0)
        self._stderr.close()


# ----- the bridge itself: runs inside a namespace -----------------------------------------------


def _op_healthy(address: str, timeout_s: float) -> bool:
    import grpc

    from beamsplit.server.server_common import check_health

    with grpc.insecure_channel(address) as channel:
        return bool(check_health(channel, timeout_s=timeout_s))


def _op_generate(
    target: str, token_ids: list[int], beam_width: int, max_new_tokens: int, salt_hex: str, timeout_s: float
) -> dict[str, Any]:
    import grpc

    from beamsplit.client.grpc_client import BeamsplitClient, build_request
    from beamsplit.v1 import common_pb2

    sampling = common_pb2.SamplingOptions(beam_width=beam_width, max_new_tokens=max_new_tokens)
    request = build_request(token_ids=token_ids, sampling=sampling, salt=bytes.fromhex(salt_hex))
    with BeamsplitClient(target) as client:
        try:
            result = client.generate(request, timeout_s=timeout_s)
        except grpc.RpcError as error:
            return {"error": {"code": error.code().name, "details": error.details()}}
    beams = [
        {
            "token_ids": list(beam.token_ids),
            "score": beam.score,
            "cumulative_logprob": beam.cumulative_logprob,
            "finish_reason": str(beam.finish_reason),
        }
        for beam in result.beams
    ]
    return {"beams": beams, "stats": result.stats}


def _op_metric(url: str, name: str) -> float | None:
    from beamsplit.server.metrics import read_gauge

    with urllib.request.urlopen(url, timeout=5.0) as response:
        return read_gauge(response.read().decode(), name)


def _op_connect(host: str, port: int) -> str:
    """'connected', or the error's class name (ConnectionRefusedError, TimeoutError, ...)."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return "connected"
    except OSError as error:
        return type(error).__name__


_OPS: dict[str, Callable[..., Any]] = {
    "healthy": _op_healthy,
    "generate": _op_generate,
    "metric": _op_metric,
    "connect": _op_connect,
}


def _serve_bridge() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            reply: dict[str, Any] = {"result": _OPS[op](**request)}
        except Exception as error:  # noqa: BLE001 - reported to the caller, who fails the test
            reply = {"bridge_error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] != ["bridge"]:
        raise SystemExit("usage: python -m tests.netns_helpers bridge")
    _serve_bridge()
