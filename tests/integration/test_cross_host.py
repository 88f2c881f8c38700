"""Cross-host: the context worker and the generation worker in two Linux network namespaces.

Layout (docs/cross_host.md): namespace A holds the context worker, bound to 10.231.7.1; namespace
B holds the generation worker, bound to 10.231.7.2, and the coordinator and the aggregated
reference on B's loopback. A and B are joined by one veth pair and nothing else, so every byte
between the workers crosses it. The test process stays in the root namespace and reaches B through
a bridge process (tests/netns_helpers.py), which also reads every worker's /metrics.

Three deployments (context worker, generation worker, coordinator) share the namespaces and the
aggregated reference:
- `tcp`: workers started with UCX_TLS=tcp. Both namespaces share this host's IPC and PID
  namespaces, so by default UCX still sees one node and picks shared memory and cma; forcing tcp
  puts the KV pull on the veth, which the tests prove from the veth's byte counter and from UCX's
  protocol table (UCX_PROTO_INFO=y in the workers' logs). Parity, transferred blocks, pools.
- `shm`: UCX's own same-host transports (cma for the pages; small messages over tcp, since transfer/
  excludes the shared-memory FIFO transports) with UCX_ADAPTIVE_PROGRESS=n: parity, and the pages
  do not cross the veth.
- `default`: UCX's own transports, untouched (before transfer/ set UCX_ADAPTIVE_PROGRESS=n a pull
  between the two namespaces never completed; docs/cross_host.md).

Skipped, with the reason, where network namespaces cannot be created (not root, no iproute2, an
unprivileged container).
"""

from __future__ import annotations

import random
import re
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from beamsplit.launch.launcher import WORKER_ROLES, PortPicker
from beamsplit.launch.local_cluster import DEFAULT_ENGINE_ARGUMENTS
from tests.netns_helpers import (
    Bridge,
    NetnsPair,
    NetnsUnavailable,
    NsProcess,
    NsProcessGroup,
    listening_tcp_addresses,
)

BLOCK = 32
MAX_NEW_TOKENS = 6
SCORE_TOLERANCE = 1e-9
STARTUP_TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"
PORTS = PortPicker()  # one per test run: ports are never handed out twice
SERVE = [sys.executable, "-m", "beamsplit.cli", "serve"]
QUIET_UCX = {"UCX_PROTO_INFO": "y", "UCX_WARN_UNUSED_ENV_VARS": "n"}
TCP_ENV = {"UCX_TLS": "tcp", **QUIET_UCX}
# UCX's own transports, with every interface polled on every progress call (docs/cross_host.md).
SHM_ENV = {"UCX_ADAPTIVE_PROGRESS": "n", **QUIET_UCX}
PROTO_INFO_ROW = re.compile(r"\|\s*[^|]*\|\s*[^|]*\|\s*([a-z0-9_]+/[\w.@-]+)\s*\|\s*$")


@dataclass
class Server:
    process: NsProcess
    host: str
    port: int
    metrics_port: int

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def ucx_address(self) -> str:
        match = re.search(r", ucx (\S+:\d+)", self.process.log())
        assert match, f"{self.name} did not announce its UCX listener:\n{self.process.log_tail()}"
        return match.group(1)

    def ucx_transports(self) -> set[str]:
        """Transports in the protocol tables UCX printed (UCX_PROTO_INFO=y), e.g. {'tcp/veth0'}."""
        return {
            match.group(1)
            for line in self.process.log().splitlines()
            if (match := PROTO_INFO_ROW.search(line))
        }


@dataclass
class Variant:
    context: Server
    generation: Server
    coordinator: Server


@dataclass
class Deployment:
    pair: NetnsPair
    bridge: Bridge
    tcp: Variant
    shm: Variant
    default: Variant
    aggregated: Server


def start(
    group: NsProcessGroup,
    name: str,
    namespace: str,
    role: str,
    host: str,
    arguments: list[str],
    env: dict[str, str] | None = None,
) -> Server:
    # Free in the root namespace too (the bind test needs that), and below the ephemeral range.
    port, metrics_port = PORTS.pick(), PORTS.pick()
    argv = [
        *SERVE,
        role,
        "--host",
        host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *arguments,
    ]
    if role in WORKER_ROLES:
        # Separate hosts to the network, not to the CPU: the workers take turns on its cores.
        argv += ["--shares-cores", "--core-lease-file", str(group.log_dir / "cores.lock")]
    return Server(group.start(name, namespace, argv, env), host, port, metrics_port)


def wait_healthy(bridge: Bridge, servers: list[Server], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while not bridge.call("healthy", address=server.address, timeout_s=1.0):
            if not server.process.is_alive() or time.monotonic() > deadline:
                state = "exited" if not server.process.is_alive() else "not healthy in time"
                raise RuntimeError(
                    f"{server.name} ({server.address}) {state}; log:\n{server.process.log_tail()}"
                )
            time.sleep(0.1)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    try:
        pair = NetnsPair.create()
    except NetnsUnavailable as reason:
        pytest.skip(str(reason))
    log_dir: Path = tmp_path_factory.mktemp("cross-host")
    group = NsProcessGroup(log_dir)
    bridge: Bridge | None = None
    codes: dict[str, int | None] = {}
    try:
        engine = list(DEFAULT_ENGINE_ARGUMENTS)
        a, b = pair.address_a, pair.address_b
        variants = {}
        for label, env, extra_generation, extra_coordinator in (
            ("tcp", TCP_ENV, [], []),
            ("shm", SHM_ENV, [], []),
            # Should the default-transport pull hang again, fail it fast and once.
            ("default", QUIET_UCX, ["--pull-timeout-s", "3"], ["--max-attempts", "1"]),
        ):
            context = start(group, f"context-{label}", pair.ns_a, "context", a, engine, env)
            generation = start(
                group, f"generation-{label}", pair.ns_b, "generation", b, [*engine, *extra_generation], env
            )
            coordinator = start(
                group, f"coordinator-{label}", pair.ns_b, "coordinator", LOOPBACK,
                ["--context", context.address, "--generation", generation.address, *extra_coordinator],
            )  # fmt: skip
            variants[label] = Variant(context, generation, coordinator)
        aggregated = start(group, "aggregated", pair.ns_b, "aggregated", LOOPBACK, engine)
        bridge = Bridge(pair.ns_b, log_dir / "bridge.log")
        servers = [server for variant in variants.values() for server in vars(variant).values()]
        wait_healthy(bridge, [*servers, aggregated], STARTUP_TIMEOUT_S)
        yield Deployment(pair, bridge, variants["tcp"], variants["shm"], variants["default"], aggregated)
    finally:
        if bridge is not None:
            bridge.close()
        codes = group.stop_all()
        pair.destroy()
    assert not pair.exists(), f"namespaces {pair.ns_a} / {pair.ns_b} survived the teardown"
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}; logs in {log_dir}"


def prompt_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


def generate(
    deployment: Deployment, target: Server, token_ids: list[int], beam_width: int, salt: bytes = b""
) -> dict[str, Any]:
    result: dict[str, Any] = deployment.bridge.call(
        "generate", target=target.address, token_ids=token_ids, beam_width=beam_width,
        max_new_tokens=MAX_NEW_TOKENS, salt_hex=salt.hex(), timeout_s=60.0,
    )  # fmt: skip
    return result


def assert_parity(result: dict[str, Any], reference: dict[str, Any], beam_width: int) -> None:
    assert "error" not in result, result["error"]
    assert "error" not in reference, reference["error"]
    assert len(result["beams"]) == len(reference["beams"]) == beam_width
    for index, (beam, expected) in enumerate(zip(result["beams"], reference["beams"], strict=True)):
        assert beam["token_ids"] == expected["token_ids"], f"beam {index} tokens differ"
        assert beam["finish_reason"] == expected["finish_reason"]
        assert beam["score"] == pytest.approx(expected["score"], abs=SCORE_TOLERANCE), f"beam {index} score"
        assert beam["cumulative_logprob"] == pytest.approx(
            expected["cumulative_logprob"], abs=SCORE_TOLERANCE
        )


def blocks_in_use(deployment: Deployment, servers: list[Server]) -> dict[str, float | None]:
    return {
        server.name: deployment.bridge.call(
            "metric", url=server.metrics_url, name="beamsplit_kv_blocks_in_use"
        )
        for server in servers
    }


def assert_pools_empty(deployment: Deployment, servers: list[Server], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    blocks = blocks_in_use(deployment, servers)
    while any(value != 0 for value in blocks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        blocks = blocks_in_use(deployment, servers)
    assert all(value == 0 for value in blocks.values()), f"KV blocks still in use: {blocks}"


@pytest.mark.parametrize("beam_width", [1, 4])
@pytest.mark.parametrize("prompt_len", [64, 67])
def test_parity_and_pull_over_the_veth(deployment: Deployment, prompt_len: int, beam_width: int) -> None:
    variant, pair = deployment.tcp, deployment.pair
    token_ids = prompt_tokens(prompt_len, seed=10 * prompt_len + beam_width)
    num_pages = -(-prompt_len // BLOCK)

    sent_before = pair.tx_bytes(pair.ns_a, pair.veth_a)
    first = generate(deployment, variant.coordinator, token_ids, beam_width)
    sent = pair.tx_bytes(pair.ns_a, pair.veth_a) - sent_before
    assert_parity(first, generate(deployment, deployment.aggregated, token_ids, beam_width), beam_width)
    stats = first["stats"]
    assert stats["context_worker"] == variant.context.address
    assert stats["generation_worker"] == variant.generation.address
    assert stats["transferred_blocks"] == num_pages
    assert stats["context_reused_tokens"] == stats["generation_reused_tokens"] == 0
    # The pages left namespace A through its veth end (with shared memory or cma they would not
    # touch it: the gRPC calls alone send a few KiB, a 64-token prompt is 64 KiB of pages).
    assert stats["transferred_bytes"] >= num_pages * 16 * 1024
    assert sent >= stats["transferred_bytes"], f"veth sent {sent} B for a {stats['transferred_bytes']} B pull"

    again = generate(deployment, variant.coordinator, token_ids, beam_width)
    assert_parity(again, generate(deployment, deployment.aggregated, token_ids, beam_width), beam_width)
    assert_parity(again, first, beam_width)
    reusable = (prompt_len - 1) // BLOCK  # lookups use prompt[:-1]: the last token's block is pulled
    assert again["stats"]["transferred_blocks"] == num_pages - reusable < num_pages
    assert (
        again["stats"]["context_reused_tokens"]
        == again["stats"]["generation_reused_tokens"]
        == reusable * BLOCK
    )
    assert again["stats"]["transferred_bytes"] < stats["transferred_bytes"]
    assert_pools_empty(deployment, [variant.context, variant.generation, deployment.aggregated])


def test_ucx_chose_tcp_on_the_veth(deployment: Deployment) -> None:
    variant, pair = deployment.tcp, deployment.pair
    result = generate(deployment, variant.coordinator, prompt_tokens(67, seed=7), 2, salt=b"transports")
    assert "error" not in result, result["error"]
    holder, puller = variant.context.ucx_transports(), variant.generation.ucx_transports()
    # The holder's endpoint to the puller (every KV page it sends) and the puller's reply endpoint.
    assert holder == {f"tcp/{pair.veth_a}"}, holder
    assert f"tcp/{pair.veth_b}" in puller, puller
    assert not {transport for transport in holder | puller if not transport.startswith("tcp/")}, (
        holder | puller
    )
    assert_pools_empty(deployment, [variant.context, variant.generation])


def test_workers_bind_only_their_namespace_address(deployment: Deployment) -> None:
    pair = deployment.pair
    for server in (deployment.tcp.context, deployment.default.context):
        ucx_port = int(server.ucx_address().rpartition(":")[2])
        assert server.ucx_address() == f"{pair.address_a}:{ucx_port}"
        ports = {server.port, server.metrics_port, ucx_port}
        for port in sorted(ports):
            # Root namespace: nothing of the worker on 127.0.0.1 (these ports were free here).
            with (
                pytest.raises(ConnectionRefusedError),
                socket.create_connection((LOOPBACK, port), timeout=2.0),
            ):
                pass
            # Namespace B: A's address answers over the veth, B's own loopback does not.
            assert deployment.bridge.call("connect", host=pair.address_a, port=port) == "connected"
            assert deployment.bridge.call("connect", host=LOOPBACK, port=port) == "ConnectionRefusedError"
        # Inside A, each of the worker's ports listens on A's address and on nothing else.
        listening = listening_tcp_addresses(server.process.pid)
        assert {(address, port) for address, port in listening if port in ports} == {
            (pair.address_a, port) for port in ports
        }
    generation = deployment.tcp.generation
    listening = listening_tcp_addresses(generation.process.pid)
    assert {address for address, port in listening if port in (generation.port, generation.metrics_port)} == {
        pair.address_b
    }


def test_shared_memory_pull_across_namespaces_without_adaptive_progress(deployment: Deployment) -> None:
    # Same host, so UCX picks shared memory and cma when it may: parity holds, and the pages do not
    # cross the veth (which is what makes the tcp test's byte count a proof).
    variant, pair = deployment.shm, deployment.pair
    token_ids = prompt_tokens(67, seed=67)
    sent_before = pair.tx_bytes(pair.ns_a, pair.veth_a)
    result = generate(deployment, variant.coordinator, token_ids, 4)
    sent = pair.tx_bytes(pair.ns_a, pair.veth_a) - sent_before
    assert_parity(result, generate(deployment, deployment.aggregated, token_ids, 4), 4)
    assert result["stats"]["transferred_blocks"] == 3
    assert sent < result["stats"]["transferred_bytes"], (
        f"veth sent {sent} B for a {result['stats']['transferred_bytes']} B pull"
    )
    # The pages go by cma; small messages (rendezvous requests, acknowledgements) over tcp on the
    # veth, never through a shared-memory FIFO (docs/transfer.md, "A killed peer must not stall").
    holder = variant.context.ucx_transports()
    assert "cma/memory" in holder, holder
    assert not {transport for transport in holder if transport.startswith(("sysv/", "posix/"))}, holder
    assert_pools_empty(deployment, [variant.context, variant.generation])


def test_nothing_listens_outside_the_worker_address(deployment: Deployment) -> None:
    # Every TCP listener in namespace A: the two context workers' gRPC, /metrics and transfer
    # listeners, and whatever UCX opens itself.
    listening = listening_tcp_addresses(deployment.tcp.context.process.pid)
    assert {address for address, _ in listening} == {deployment.pair.address_a}, sorted(listening)


def test_default_transports_across_namespaces(deployment: Deployment) -> None:
    variant = deployment.default
    token_ids = prompt_tokens(67, seed=99)
    result = generate(deployment, variant.coordinator, token_ids, 1)
    # Whatever the outcome, no page is stranded on either side.
    assert_pools_empty(deployment, [variant.context, variant.generation])
    assert "error" not in result, result["error"]
    assert_parity(result, generate(deployment, deployment.aggregated, token_ids, 1), 1)
