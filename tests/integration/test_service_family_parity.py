"""Disaggregated vs aggregated for every family, real processes and real UCX on loopback.

Per family one deployment (context worker, generation worker, coordinator, aggregated server) on a
tiny random checkpoint with a sliding window of 8 where the family has one (float64, block 16);
prompts well past the window and across blocks, widths 1 and 3. Beams must equal the aggregated
server's token for token and score for score; every pool returns to zero blocks in use.
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
    for prompt_len, beam_width in ((37, 3), (20, 1)):
        token_ids = prompt_tokens(prompt_len, seed=500 + prompt_len)
        result, reference = run_both(clients, token_ids, beam_width=beam_width)
        assert_parity(result, reference, beam_width)
        assert result.stats["transferred_blocks"] == -(-prompt_len // BLOCK)
        print(f"{family} P{prompt_len} W{beam_width}: {beam_width} beams equal, {result.stats}")
