"""Disaggregated vs aggregated for every family, real processes and real UCX on loopback.

Per family one deployment (context worker, generation worker, coordinator, aggregated server) on a
tiny random checkpoint with a sliding window of 8 where the family has one (float64, block 16);
prompts well past the window and across blocks, widths 1 and 3. Beams must equal the aggregated
server's token for token and score for score; every pool returns to zero blocks in use; a
sliding-window group ships only the pages inside its window, the same bytes for any beam width.
Gemma 3 (sliding and full layers, a separate rotary base, soft-capping) runs in the default suite;
the other families, which ship their pages through the same code, are marked slow.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from beamsplit.client.grpc_client import BeamsplitClient
from beamsplit.launch.local_cluster import start_local_cluster
from tests.helpers.family_checkpoints import FAMILIES, write_family_checkpoint
from tests.integration.test_service_parity import assert_parity, assert_pools_empty, prompt_tokens, run_both

pytest.importorskip("transformers")

BLOCK = 16
DEFAULT_FAMILY = "gemma3"
PARAMS = [
    pytest.param(family, marks=() if family == DEFAULT_FAMILY else (pytest.mark.slow,)) for family in FAMILIES
]


@pytest.fixture
def clients(tmp_path: Path, family: str) -> Iterator[tuple[BeamsplitClient, BeamsplitClient]]:
    # vocab 256: prompt_tokens draws ids below 256.
    model_dir = write_family_checkpoint(tmp_path / "model", family, seed=31, vocab_size=256)
    engine_arguments = ("--model", str(model_dir), "--dtype", "float64", "--tokens-per-block", str(BLOCK))
    cluster = start_local_cluster(
        tmp_path / "logs", engine_arguments=engine_arguments, startup_timeout_s=180.0
    )
    try:
        with (
            BeamsplitClient(cluster.coordinator.address) as coordinator,
            BeamsplitClient(cluster.aggregated.address) as aggregated,
        ):
            yield coordinator, aggregated
        assert_pools_empty(cluster)
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits {codes}; logs in {tmp_path / 'logs'}"


@pytest.mark.parametrize("family", PARAMS)
def test_family_beams_equal_the_aggregated_server(
    clients: tuple[BeamsplitClient, BeamsplitClient], family: str
) -> None:
    moved: dict[tuple[int, int, int], float] = {}
    # (prompt length, beam width, prompt variant): the last case repeats the first prompt, whose
    # first 2 blocks the generation worker now holds (full group: blocks 0-1; sliding group: block
    # 1, the one the window of the query at 32 sees), so it pulls block 2 only.
    for prompt_len, beam_width, variant in ((37, 3, 0), (37, 1, 1), (20, 1, 0), (37, 1, 0)):
        token_ids = prompt_tokens(prompt_len, seed=500 + prompt_len + 1000 * variant)
        result, reference = run_both(clients, token_ids, beam_width=beam_width)
        assert_parity(result, reference, beam_width)
        moved[prompt_len, beam_width, variant] = result.stats["transferred_bytes"]
        if family == DEFAULT_FAMILY:
            # Region pages (engine/region_pages.py) of the shared pool's 1-layer pages: the full
            # group's and each of the two sliding groups'. 37 tokens hold 3 full pages and, the
            # query at 37 seeing keys 30..37, each sliding group's blocks 1 and 2 only: 3 + 2 + 2 = 7
            # pages, not the all-full 3 pages of 3 layers (9); with the first 32 tokens reused,
            # block 2 of each group: 1 + 1 + 1.
            reused = result.stats["generation_reused_tokens"]
            expected = {(37, 0): 7, (20, 0): 6, (37, 32): 3}[prompt_len, reused]
            assert result.stats["transferred_blocks"] == expected, (prompt_len, reused)
        print(f"{family} P{prompt_len} W{beam_width}: {beam_width} beams equal, {result.stats}")
    assert moved[37, 3, 0] == moved[37, 1, 1]  # the window's pages, whatever the beam width
