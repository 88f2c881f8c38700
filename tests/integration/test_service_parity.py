"""Disaggregated service vs the aggregated server, real processes and real UCX on loopback.

One deployment per module (context worker, generation worker, coordinator, aggregated server;
`tiny`, float64, block 32). Every test compares beams token for token and score for score, and
afterwards every KV pool must be back to zero blocks in use (read through /metrics).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from beamsplit.client.grpc_client import BeamsplitClient, GenerateResult, build_request
from beamsplit.launch.local_cluster import LocalCluster
from beamsplit.v1 import common_pb2
from tests.helpers.clusters import assert_pools_empty, module_cluster

BLOCK = 32
MAX_NEW_TOKENS = 8
SCORE_TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from module_cluster(tmp_path_factory, "service-parity")


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
    return [rng.randrange(0, 256) for _ in range(length)]


def run_both(
    clients: tuple[BeamsplitClient, BeamsplitClient], token_ids: list[int], beam_width: int, salt: bytes = b""
) -> tuple[GenerateResult, GenerateResult]:
    coordinator, aggregated = clients
    sampling = common_pb2.SamplingOptions(beam_width=beam_width, max_new_tokens=MAX_NEW_TOKENS)
    request = build_request(token_ids=token_ids, sampling=sampling, salt=salt)
    return coordinator.generate(request, timeout_s=120.0), aggregated.generate(request, timeout_s=120.0)


def assert_parity(result: GenerateResult, reference: GenerateResult, beam_width: int) -> None:
    assert len(result.beams) == len(reference.beams) == beam_width
    for index, (beam, expected) in enumerate(zip(result.beams, reference.beams, strict=True)):
        assert beam.token_ids == expected.token_ids, f"beam {index} tokens differ"
        assert beam.finish_reason == expected.finish_reason
        assert beam.score == pytest.approx(expected.score, abs=SCORE_TOLERANCE), f"beam {index} score"
        assert beam.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=SCORE_TOLERANCE)


def full_blocks_before_last_token(prompt_len: int) -> int:
    # Lookups use prompt[:-1]: the block holding the last prompt token is always recomputed.
    return (prompt_len - 1) // BLOCK


@pytest.mark.parametrize("prompt_len", [64, 67])
def test_beam1_parity(clients: tuple[BeamsplitClient, BeamsplitClient], prompt_len: int) -> None:
    token_ids = prompt_tokens(prompt_len, seed=100 + prompt_len)
    result, reference = run_both(clients, token_ids, beam_width=1)
    assert_parity(result, reference, 1)
    assert result.stats["transferred_blocks"] == -(-prompt_len // BLOCK)
    assert result.stats["prompt_tokens"] == prompt_len


@pytest.mark.parametrize("prompt_len", [64, 67])
def test_beam2_with_reuse(clients: tuple[BeamsplitClient, BeamsplitClient], prompt_len: int) -> None:
    token_ids = prompt_tokens(prompt_len, seed=200 + prompt_len)
    num_pages = -(-prompt_len // BLOCK)
    first, reference = run_both(clients, token_ids, beam_width=2)
    assert_parity(first, reference, 2)
    assert first.stats["context_reused_tokens"] == 0
    assert first.stats["generation_reused_tokens"] == 0
    assert first.stats["transferred_blocks"] == num_pages
    assert first.stats["transferred_bytes"] > 0

    again, reference_again = run_both(clients, token_ids, beam_width=2)
    assert_parity(again, reference_again, 2)
    assert_parity(again, first, 2)
    reusable = full_blocks_before_last_token(prompt_len)
    assert again.stats["context_reused_tokens"] == reusable * BLOCK
    assert again.stats["generation_reused_tokens"] == reusable * BLOCK
    assert again.stats["transferred_blocks"] == num_pages - reusable
    assert again.stats["transferred_bytes"] < first.stats["transferred_bytes"]


@pytest.mark.parametrize("prompt_len", [64, 67])
def test_beam4_without_reuse(clients: tuple[BeamsplitClient, BeamsplitClient], prompt_len: int) -> None:
    token_ids = prompt_tokens(prompt_len, seed=300 + prompt_len)
    result, reference = run_both(clients, token_ids, beam_width=4)
    assert_parity(result, reference, 4)
    assert result.stats["context_reused_tokens"] == 0
    assert result.stats["generation_reused_tokens"] == 0
    assert result.stats["transferred_blocks"] == -(-prompt_len // BLOCK)


def test_transferred_blocks_do_not_depend_on_beam_width(
    clients: tuple[BeamsplitClient, BeamsplitClient],
) -> None:
    # The same prompt under a new salt each time: nothing is reused, so each width pulls it whole.
    token_ids = prompt_tokens(67, seed=400)
    transferred = {}
    for beam_width in (1, 2, 4, 8):
        result, reference = run_both(clients, token_ids, beam_width, salt=f"width-{beam_width}".encode())
        assert_parity(result, reference, beam_width)
        transferred[beam_width] = (result.stats["transferred_blocks"], result.stats["transferred_bytes"])
    assert len(set(transferred.values())) == 1, transferred
    assert transferred[1][0] == 3


def test_repeated_transfers(clients: tuple[BeamsplitClient, BeamsplitClient]) -> None:
    for round_index in range(6):
        prompt_len = (64, 67)[round_index % 2]
        beam_width = (1, 2, 4)[round_index % 3]
        token_ids = prompt_tokens(prompt_len, seed=500 + round_index)
        result, reference = run_both(clients, token_ids, beam_width)
        assert_parity(result, reference, beam_width)
        assert result.stats["transferred_blocks"] == -(-prompt_len // BLOCK)


@pytest.mark.parametrize("beam_width", [1, 4])
def test_streaming_deltas_match_final_beams(
    clients: tuple[BeamsplitClient, BeamsplitClient], beam_width: int
) -> None:
    token_ids = prompt_tokens(67, seed=600 + beam_width)
    result, reference = run_both(clients, token_ids, beam_width)
    assert_parity(result, reference, beam_width)
    assert result.deltas, "no delta was streamed before the final message"
    history = result.streamed_beams()
    # The final message carries whole beams; the deltas before it carry each step's live beams,
    # so a finished beam is a streamed live beam plus the token that finished it.
    seen = {tuple(beam) for step in history for beam in step}
    for beam in result.beams:
        assert tuple(beam.token_ids[:-1]) in seen
    if beam_width == 1:
        assert history[-1] == [result.beams[0].token_ids[:-1]]
    # Both servers stream the same live beams (their deltas may group steps differently).
    assert history[-1] == reference.streamed_beams()[-1]


def test_concurrent_requests_keep_parity(clients: tuple[BeamsplitClient, BeamsplitClient]) -> None:
    # Requests share the generation worker's batch; each must still equal its solo aggregated run.
    coordinator, aggregated = clients
    cases = [
        (prompt_tokens((64, 67)[index % 2], seed=800 + index), (1, 2, 4)[index % 3]) for index in range(6)
    ]
    requests = [
        build_request(
            token_ids=token_ids, sampling=common_pb2.SamplingOptions(beam_width=width, max_new_tokens=6)
        )
        for token_ids, width in cases
    ]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        results = list(pool.map(lambda request: coordinator.generate(request, timeout_s=120.0), requests))
    for request, result, (_, width) in zip(requests, results, cases, strict=True):
        assert_parity(result, aggregated.generate(request, timeout_s=120.0), width)


STATS_KEYS = (
    "prompt_tokens", "context_reused_tokens", "generation_reused_tokens", "transferred_blocks",
    "transferred_bytes", "transfer_ms", "ttft_ms", "e2e_ms", "context_worker", "generation_worker",
)  # fmt: skip


def test_generate_target_prints_the_offline_json(cluster: LocalCluster) -> None:
    token_ids = ",".join(str(token) for token in prompt_tokens(67, seed=700))
    arguments = ["--token-ids", token_ids, "--beam-width", "2", "--max-new-tokens", "4", "--json"]

    def run(*extra: str) -> dict[str, Any]:
        command = [sys.executable, "-m", "beamsplit.cli", "generate", *arguments, *extra]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
        return json.loads(completed.stdout)  # type: ignore[no-any-return]

    remote = run("--target", cluster.coordinator.address)
    offline = run("--dtype", "float64")
    assert remote["beams"] == offline["beams"]
    assert all(key in remote["stats"] for key in STATS_KEYS), remote["stats"]
    assert remote["stats"]["generation_worker"] == cluster.generation.address
    assert_pools_empty(cluster)
