"""Bad requests are refused up front with INVALID_ARGUMENT and a message naming the field, by the
coordinator and the aggregated server alike, and leave no KV blocks behind."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.local_cluster import LocalCluster, start_local_cluster
from beamsplit.v1 import common_pb2, coordinator_pb2

TINY_VOCAB = 260
TINY_MAX_POSITIONS = 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    started = start_local_cluster(tmp_path_factory.mktemp("service-validation"), startup_timeout_s=180.0)
    try:
        yield started
    finally:
        codes = started.stop()
    assert all(code == 0 for code in codes.values()), codes


def sampling(**fields: object) -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(**fields)  # type: ignore[arg-type]


BAD_REQUESTS = [
    ("no prompt", coordinator_pb2.GenerateRequest(), "prompt"),
    ("empty text", build_request(prompt=""), "prompt.text"),
    ("empty token ids", build_request(token_ids=[]), "prompt.token_ids"),
    ("unknown token id", build_request(token_ids=[1, 2, TINY_VOCAB]), "prompt.token_ids[2]"),
    ("negative token id", build_request(token_ids=[-1]), "prompt.token_ids[0]"),
    ("beam width 0", build_request(prompt="hi", sampling=sampling(beam_width=0)), "sampling.beam_width"),
    ("beam width 65", build_request(prompt="hi", sampling=sampling(beam_width=65)), "sampling.beam_width"),
    (
        "max new tokens 0",
        build_request(prompt="hi", sampling=sampling(max_new_tokens=0)),
        "sampling.max_new_tokens",
    ),
    (
        "max new tokens huge",
        build_request(prompt="hi", sampling=sampling(max_new_tokens=100_000)),
        "sampling.max_new_tokens",
    ),
    ("top_p 0", build_request(prompt="hi", sampling=sampling(top_p=0.0)), "sampling.top_p"),
    ("negative top_k", build_request(prompt="hi", sampling=sampling(top_k=-1)), "sampling.top_k"),
    (
        "negative temperature",
        build_request(prompt="hi", sampling=sampling(temperature=-1.0)),
        "sampling.temperature",
    ),
    (
        "sampling with beams",
        build_request(prompt="hi", sampling=sampling(temperature=0.7, beam_width=2)),
        "sampling.temperature",
    ),
    (
        "nan length penalty",
        build_request(prompt="hi", sampling=sampling(length_penalty=float("nan"))),
        "sampling.length_penalty",
    ),
    (
        "unknown eos",
        build_request(prompt="hi", sampling=sampling(eos_token_id=TINY_VOCAB)),
        "sampling.eos_token_id",
    ),
    (
        "too long",
        build_request(token_ids=[1] * (TINY_MAX_POSITIONS - 4), sampling=sampling(max_new_tokens=16)),
        "prompt is too long",
    ),
]


@pytest.mark.parametrize(
    ("case", "request_message", "field"), BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS]
)
def test_invalid_requests_name_the_field(
    cluster: LocalCluster, case: str, request_message: coordinator_pb2.GenerateRequest, field: str
) -> None:
    details = []
    for address in (cluster.coordinator.address, cluster.aggregated.address):
        with BeamsplitClient(address) as client, pytest.raises(grpc.RpcError) as raised:
            client.generate(request_message, timeout_s=30.0)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, raised.value.details())
        assert field in raised.value.details(), (case, raised.value.details())
        details.append(raised.value.details())
    assert details[0] == details[1], "coordinator and aggregated server disagree"


def test_no_blocks_left_after_refusals(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + 5.0
    while any(cluster.blocks_in_use().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(value == 0 for value in cluster.blocks_in_use().values())
