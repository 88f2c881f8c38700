"""Disaggregated vs aggregated for the hybrid `tiny-hybrid` (LFM2 layout), real processes and UCX.

The context worker ships the prompt's final recurrent state in the handoff; the generation worker
installs it before expanding beams. Beams must equal the aggregated server's token for token, and
the reuse diagnostic must travel: with partial reuse on, a prompt sharing 48 tokens is held by the
pages up to 48 but by snapshots only up to 32. Pools return to zero blocks in use.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from beamsplit.client.grpc_client import BeamsplitClient
from beamsplit.launch.local_cluster import LocalCluster
from tests.helpers.clusters import assert_pools_empty, module_cluster
from tests.integration.test_service_parity import assert_parity, run_both

BLOCK = 32
ENGINE_ARGUMENTS = ("--model", "tiny-hybrid", "--dtype", "float64", "--tokens-per-block", str(BLOCK))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from module_cluster(
        tmp_path_factory,
        "service-hybrid-parity",
        engine_arguments=ENGINE_ARGUMENTS,
        context_arguments=("--enable-partial-reuse",),
        aggregated_arguments=("--enable-partial-reuse",),
    )


@pytest.fixture
def clients(cluster: LocalCluster) -> Iterator[tuple[BeamsplitClient, BeamsplitClient]]:
    with (
        BeamsplitClient(cluster.coordinator.address) as coordinator,
        BeamsplitClient(cluster.aggregated.address) as aggregated,
    ):
        yield coordinator, aggregated
    assert_pools_empty(cluster)


def prompt_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


@pytest.mark.parametrize(("prompt_len", "beam_width"), [(64, 1), (67, 2), (33, 4)])
def test_hybrid_beams_equal_the_aggregated_server(
    clients: tuple[BeamsplitClient, BeamsplitClient], prompt_len: int, beam_width: int
) -> None:
    token_ids = prompt_tokens(prompt_len, seed=300 + prompt_len)
    result, reference = run_both(clients, token_ids, beam_width=beam_width)
    assert_parity(result, reference, beam_width)
    assert result.stats["transferred_blocks"] == -(-prompt_len // BLOCK)


def test_hybrid_reuse_is_cut_to_the_snapshot_and_reported(
    clients: tuple[BeamsplitClient, BeamsplitClient],
) -> None:
    first = prompt_tokens(67, seed=400)
    result, reference = run_both(clients, first, beam_width=2)
    assert_parity(result, reference, 2)

    second = first[:48] + prompt_tokens(20, seed=401)
    assert second[48] != first[48]
    result, reference = run_both(clients, second, beam_width=2)
    assert_parity(result, reference, 2)
    print("disaggregated stats:", result.stats)
    print("aggregated stats:", reference.stats)
    assert result.stats["context_num_tokens_before_hybrid_pruning"] == 48
    assert result.stats["context_reused_tokens"] == 32
    assert reference.stats["num_tokens_before_hybrid_pruning"] == 48
    assert reference.stats["reused_tokens"] == 32
