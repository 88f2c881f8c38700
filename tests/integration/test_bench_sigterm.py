"""SIGTERM to a running benchmark stops the servers it started (it used to orphan them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_pids(pid: int) -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.add(int(entry.name))
    return children


def is_alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_during_soak_stops_every_server(tmp_path: Path) -> None:
    log = tmp_path / "soak.err"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "beamsplit.cli", "bench", "soak", "--json", "--minutes", "5"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    servers: set[int] = set()
    try:
        deadline = time.monotonic() + 180.0
        while "traffic starts" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.5)
        assert "traffic starts" in log.read_text(), log.read_text()
        servers = child_pids(process.pid)
        assert len(servers) >= 3, servers
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90.0) != 0  # interrupted, not a report
        deadline = time.monotonic() + 30.0
        while any(is_alive(pid) for pid in servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in servers if is_alive(pid)], "servers left running after SIGTERM"
    finally:
        for pid in servers:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10.0)
