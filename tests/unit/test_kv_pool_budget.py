"""The KV pool is sized from a memory budget by default (a GiB figure or a fraction of free
memory), a block count only when asked for, and the start-up line says what was chosen."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from beamsplit.cli.engine_args import (
    DEFAULT_KV_CACHE_GIB,
    add_engine_arguments,
    describe_kv_pool,
    engine_config_from_args,
    free_memory_bytes,
    kv_pool_budget_bytes,
)
from beamsplit.launch.launcher import ProcessGroup
from engine import CacheConfig

PAGE_BYTES = 32768  # tiny in float64, block 32


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(flags))


def test_no_flag_sizes_the_pool_from_the_default_budget_whatever_the_page() -> None:
    cache = engine_config_from_args(parse()).cache
    assert cache.is_sized_by_memory and cache.max_pool_bytes == int(DEFAULT_KV_CACHE_GIB * 2**30)
    assert cache.fitted_to(PAGE_BYTES).num_blocks == 32768  # not capped at a fixed count (was 2048)
    assert cache.fitted_to(1_474_560).num_blocks == 728  # SmolLM2-135M, float32: 1.4 MiB pages


def test_a_gib_figure_a_fraction_or_an_exact_count() -> None:
    assert (
        engine_config_from_args(parse("--kv-cache-gib", "0.0625")).cache.fitted_to(PAGE_BYTES).num_blocks
        == 2048
    )
    exact = engine_config_from_args(parse("--num-blocks", "100")).cache
    assert (exact.num_blocks, exact.max_pool_bytes, exact.is_sized_by_memory) == (100, None, False)
    budget = kv_pool_budget_bytes(parse("--kv-cache-fraction", "0.01"))
    assert budget is not None and budget == pytest.approx(0.01 * free_memory_bytes("cpu"), rel=0.05)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--num-blocks", "8", "--kv-cache-gib", "1"), "--num-blocks and --kv-cache-gib"),
        (("--kv-cache-gib", "1", "--kv-cache-fraction", "0.5"), "--kv-cache-gib and --kv-cache-fraction"),
        (
            (
                "--kv-cache-fraction",
                "0.99",
            ),
            "--kv-cache-fraction must be in",
        ),
        (
            (
                "--kv-cache-gib",
                "0",
            ),
            "--kv-cache-gib must be > 0",
        ),
    ],
)
def test_conflicting_or_bad_sizes_are_refused_by_flag(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(parse(*flags))


def test_a_cap_still_lowers_an_asked_count_when_not_sized_by_memory() -> None:
    assert CacheConfig(num_blocks=4, max_pool_bytes=10 * PAGE_BYTES).fitted_to(PAGE_BYTES).num_blocks == 4
    sized = CacheConfig(num_blocks=4, max_pool_bytes=10 * PAGE_BYTES, is_sized_by_memory=True)
    assert sized.fitted_to(PAGE_BYTES).num_blocks == 10
    with pytest.raises(ValueError, match="is_sized_by_memory needs max_pool_bytes"):
        CacheConfig(is_sized_by_memory=True)


def test_the_startup_line_says_blocks_and_bytes() -> None:
    budget = CacheConfig(max_pool_bytes=2**26, is_sized_by_memory=True)
    assert (
        describe_kv_pool(2048, PAGE_BYTES, budget)
        == "KV pool 2048 blocks x 32768 B = 64.0 MiB (budget 0.0625 GiB)"
    )
    assert describe_kv_pool(100, PAGE_BYTES, CacheConfig(num_blocks=100)).endswith("= 3.1 MiB (--num-blocks)")


def test_the_launcher_gives_each_engine_a_budget_unless_its_arguments_size_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []

    class Recorded(Exception):
        """Stops `start` at the Popen call: the command is what this test checks."""

    def record(command: list[str], **_: object) -> None:
        commands.append(command)
        raise Recorded

    monkeypatch.setattr(subprocess, "Popen", record)
    group = ProcessGroup(tmp_path, kv_cache_gib=0.5)
    for role, arguments in (("context", []), ("generation", ["--num-blocks", "9"]), ("coordinator", [])):
        with pytest.raises(Recorded):
            group.start(role, role, arguments)
    assert commands[0][-2:] == ["--kv-cache-gib", "0.5"] and "--shares-cores" in commands[0]
    assert "--kv-cache-gib" not in commands[1] and "--kv-cache-gib" not in commands[2]
