"""A transfer agent in its own process, driven by JSON lines on stdin, for the two-process UCX tests.

    python -m tests.transfer_helpers --num-pages 64 --page-bytes 4096 --seed 1

It fills a pool with `seeded_pool(seed, ...)` (so the test knows every byte without reading it back),
registers it as "kv", prints {"address": ...} and then answers one JSON line per command. Commands:
offer, revoke, stats, events, close, two fault injections that act the moment a pull of ours is
being served: revoke_when_serving and die_when_serving (SIGKILL, mid-transfer); and, as a puller,
pull (answers how it ended) and pull_then_die (SIGKILLs itself once the holder has accepted).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from transfer import MemoryRegion, TransferAgent, TransferStatus, UcxTransferAgent


def seeded_pool(seed: int, num_pages: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)


class PeerProcess:
    """The test side of a helper process: start it, call it, and kill it by pid whatever happens."""

    def __init__(self, num_pages: int, page_bytes: int, seed: int, device: str = "cpu") -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.transfer_helpers",
                "--num-pages",
                str(num_pages),
                "--page-bytes",
                str(page_bytes),
                "--seed",
                str(seed),
                "--device",
                device,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
        )
        hello = self._read_line(20.0)
        self.address: str = hello["address"]
        self.binding: str = hello["binding"]

    def call(self, op: str, timeout_s: float = 10.0, **arguments: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        return self._read_line(timeout_s)

    def _read_line(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(
                f"transfer helper (pid {self.process.pid}) did not answer within {timeout_s} s"
            )
        line = self.process.stdout.readline()
        if not line:
            raise EOFError(f"transfer helper (pid {self.process.pid}) exited with {self.process.wait(5)}")
        return dict(json.loads(line))

    def pull_then_die(self, offer: Any, num_pages: int) -> None:
        """Pulls the offer's first `num_pages` pages (into reversed pages here) and is SIGKILLed
        mid-transfer by its own hand; returns once it is dead."""
        self.call(
            "pull_then_die",
            address=offer.address,
            transfer_id=offer.transfer_id,
            secret=offer.secret,
            src_page_ids=list(range(num_pages)),
            dst_page_ids=list(range(num_pages - 1, -1, -1)),
        )
        assert self.process.wait(timeout=20.0) == -signal.SIGKILL

    def signal(self, signal_number: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal_number)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def _when_serving(agent: TransferAgent, action: Any) -> None:
    """Runs `action` as soon as a pull is being served (polls: this is a test fault, not a hot path)."""
    deadline = time.monotonic() + 20.0
    while agent.stats().num_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.0002)
    action()


def _pull_into_pool(agent: TransferAgent, command: dict[str, Any]) -> Any:
    """A pull from the agent named in `command` into our own pool ("kv")."""
    return agent.pull(
        command["address"],
        command["transfer_id"],
        command["secret"],
        "kv",
        command["src_page_ids"],
        "kv",
        command["dst_page_ids"],
        command.get("timeout_s", 10.0),
        checksum=command.get("checksum", False),
    )


def _die_once_accepted(handle: Any) -> None:
    deadline = time.monotonic() + 20.0
    while handle.status is TransferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGKILL)


def _serve(arguments: argparse.Namespace) -> None:
    # Answers go to the original stdout; UCX may log there (UCX_PROTO_INFO=y), so send fd 1 to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    pool = seeded_pool(arguments.seed, arguments.num_pages, arguments.page_bytes)
    address = pool.ctypes.data
    if arguments.device != "cpu":  # the same bytes in device memory (tests/gpu)
        import torch

        device_pool = torch.from_numpy(pool).to(arguments.device)
        address = device_pool.data_ptr()
    agent = UcxTransferAgent()
    agent.register(
        "kv", MemoryRegion(address, arguments.page_bytes, arguments.num_pages, device=arguments.device)
    )
    events: list[tuple[str, str]] = []
    offers: list[str] = []

    def answer(payload: dict[str, Any]) -> None:
        answers.write(json.dumps(payload) + "\n")
        answers.flush()

    def on_done(transfer_id: str, status: TransferStatus) -> None:
        events.append((transfer_id, status.name))

    answer({"address": agent.address, "binding": agent.binding_name})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "offer":
            offer = agent.offer("kv", command["page_ids"], command.get("ttl_s", 10.0), on_done)
            offers.append(offer.transfer_id)
            answer({"transfer_id": offer.transfer_id, "secret": offer.secret, "address": offer.address})
        elif op == "revoke":
            agent.revoke(command["transfer_id"])
            answer({"ok": True})
        elif op == "revoke_when_serving":
            threading.Thread(
                target=_when_serving, args=(agent, lambda: agent.revoke(offers[-1])), daemon=True
            ).start()
            answer({"ok": True})
        elif op == "die_when_serving":
            kill_self = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            threading.Thread(target=_when_serving, args=(agent, kill_self), daemon=True).start()
            answer({"ok": True})
        elif op == "pull":
            # Pulls from another agent into our own pool and answers how it ended.
            handle = _pull_into_pool(agent, command)
            status = handle.wait(command.get("timeout_s", 10.0) + 1.0)
            answer({"status": status.name, "error": handle.error})
        elif op == "pull_then_die":
            # The same, but SIGKILLs this process as soon as the holder has accepted (its sends are
            # posted): a puller dying mid-transfer.
            handle = _pull_into_pool(agent, command)
            answer({"ok": True})  # first: the kill may come at once
            threading.Thread(target=_die_once_accepted, args=(handle,), daemon=True).start()
        elif op == "stats":
            stats = agent.stats()
            answer(
                {
                    "num_in_flight": stats.num_in_flight,
                    "num_offers": stats.num_offers,
                    "reserved_bytes": stats.reserved_bytes,
                }
            )
        elif op == "events":
            answer({"events": events})
        elif op == "close":
            agent.close()
            answer({"ok": True})
            return


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-pages", type=int, required=True)
    parser.add_argument("--page-bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--device", default="cpu", help="where the pool lives: cpu or cuda:N")
    _serve(parser.parse_args())
