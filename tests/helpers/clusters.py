"""A local deployment per test module, and the check that every KV pool is back to empty.

`module_cluster` is the body of a module-scoped fixture: it starts the four processes
(beamsplit.launch.local_cluster), yields them, and stops them by pid after the module even when
a test failed; every process must then have exited cleanly (its log folder is named otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from beamsplit.launch.local_cluster import LocalCluster, start_local_cluster


def module_cluster(
    tmp_path_factory: pytest.TempPathFactory, name: str, **options: Any
) -> Iterator[LocalCluster]:
    log_dir = tmp_path_factory.mktemp(name)
    started = start_local_cluster(log_dir, **{"startup_timeout_s": 180.0, **options})
    try:
        yield started
    finally:
        codes = started.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}; logs in {log_dir}"


def assert_pools_empty(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    """Every process's KV pool back to zero blocks in use within timeout_s (read through /metrics)."""
    deadline = time.monotonic() + timeout_s
    blocks = cluster.blocks_in_use()
    while any(value != 0 for value in blocks.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        blocks = cluster.blocks_in_use()
    assert all(value == 0 for value in blocks.values()), f"KV blocks still in use: {blocks}"
