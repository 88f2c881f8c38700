"""Random requests at a running coordinator and aggregated server, over gRPC and HTTP.

Every answer is a valid result or a clean refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED; HTTP
400, 413, 429): never INTERNAL/UNKNOWN/500, never a hang (every call has a deadline), and
afterwards no KV block is left in use anywhere. Values straddle each limit (token ids around the
vocabulary, widths around 1 and 64, NaN and infinities, wrong JSON types, random wire bytes);
valid requests stay short (max_new_tokens <= 4, prompts <= 48 tokens) so the module stays fast.
Derandomized: a failure reproduces on the next run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from beamsplit.launch.local_cluster import LocalCluster, start_local_cluster
from beamsplit.v1 import common_pb2, coordinator_pb2
from tests.helpers.bad_input import TINY_MAX_POSITIONS, TINY_VOCAB

CALL_TIMEOUT_S = 60.0
CLEAN_GRPC = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
CLEAN_HTTP = {200, 400, 413, 429}
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    started = start_local_cluster(tmp_path_factory.mktemp("request-fuzz"), startup_timeout_s=180.0, http=True)
    try:
        yield started
        deadline = time.monotonic() + 10.0
        while any(started.blocks_in_use().values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        blocks = started.blocks_in_use()
        assert all(value == 0 for value in blocks.values()), f"leaked KV blocks after fuzzing: {blocks}"
    finally:
        codes = started.stop()
    assert all(code == 0 for code in codes.values()), codes


def around(*edges: int) -> st.SearchStrategy[int]:
    """Integers at and next to each edge, plus anything in int32."""
    near = [value + delta for value in edges for delta in (-1, 0, 1)]
    return st.one_of(st.sampled_from(near), st.integers(-(2**31), 2**31 - 1))


token_ids = st.one_of(st.integers(0, TINY_VOCAB - 1), around(0, TINY_VOCAB), st.integers(-(2**63), 2**63 - 1))
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, -1.0, 1e-9, 1.5])
)
small_tokens = st.one_of(st.integers(1, 4), around(0, 4097), st.integers(-(2**31), 0))
widths = st.one_of(st.integers(1, 4), around(0, 64, 65), st.integers(-(2**31), 0))


@st.composite
def sampling_options(draw: st.DrawFn) -> common_pb2.SamplingOptions:
    options = common_pb2.SamplingOptions()
    for name, values in [
        ("beam_width", widths),
        ("max_new_tokens", small_tokens),
        ("length_penalty", floats),
        ("eos_token_id", around(0, TINY_VOCAB)),
        ("top_p", floats),
        ("seed", st.integers(-(2**63), 2**63 - 1)),
        ("temperature", floats),
        ("top_k", around(0, TINY_VOCAB)),
        ("early_stopping", st.integers(-3, 5)),
        ("ignore_eos", st.booleans()),
    ]:
        if draw(st.booleans()):
            setattr(options, name, draw(values))
    if options.max_new_tokens > 4 and options.max_new_tokens <= 4096:
        options.max_new_tokens = 4  # valid but long: a cost, not a case
    return options


@st.composite
def generate_requests(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=64))  # not a protobuf, or a lucky one
    request = coordinator_pb2.GenerateRequest(
        request_id=draw(st.text(max_size=8)), salt=draw(st.binary(max_size=8))
    )
    kind = draw(st.sampled_from(["text", "ids", "long", "none"]))
    if kind == "text":
        request.text = draw(st.text(max_size=48))
    elif kind == "ids":
        request.token_ids.token_ids.extend(draw(st.lists(token_ids, max_size=48)))
    elif kind == "long":
        request.token_ids.token_ids.extend([1] * (TINY_MAX_POSITIONS + draw(st.integers(-8, 8))))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_options()))
    return request.SerializeToString()


def check_grpc(address: str, wire: bytes) -> None:
    with grpc.insecure_channel(address) as channel:
        generate = channel.unary_stream("/beamsplit.v1.Coordinator/Generate")
        try:
            responses = [
                common_pb2.GenerateResponse.FromString(raw) for raw in generate(wire, timeout=CALL_TIMEOUT_S)
            ]
        except grpc.RpcError as error:
            assert error.code() in CLEAN_GRPC, (address, error.code(), error.details(), wire[:200])
            assert error.details(), "a refusal without a message"
            event(f"grpc {error.code().name}")
            return
    event("grpc ok")
    finals = [response for response in responses if response.HasField("final")]
    assert len(finals) == 1 and responses[-1].HasField("final"), (address, wire[:200])
    assert finals[0].final.beams, (address, wire[:200])


@given(wire=generate_requests())
@FUZZ
def test_fuzz_grpc(cluster: LocalCluster, wire: bytes) -> None:
    for server in (cluster.coordinator, cluster.aggregated):
        check_grpc(server.address, wire)


json_values = st.one_of(
    st.none(), st.booleans(), around(0, 1, 4, 64, 65, TINY_VOCAB), floats.filter(lambda value: not math.isnan(value)),
    st.just(float("nan")), st.text(max_size=12), st.lists(st.integers(-5, 300), max_size=8),
)  # fmt: skip
HTTP_FIELDS = ["prompt", "max_tokens", "n", "best_of", "temperature", "top_p", "top_k", "use_beam_search",
               "seed", "stop", "stream", "length_penalty", "early_stopping", "stop_token_ids", "frobnicate"]  # fmt: skip


@st.composite
def completion_bodies(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=64))
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": draw(st.one_of(st.text(max_size=48), st.lists(token_ids, max_size=48))),
    }
    for name in draw(st.lists(st.sampled_from(HTTP_FIELDS), max_size=5, unique=True)):
        body[name] = draw(json_values)
    if isinstance(body.get("max_tokens"), int) and 4 < body["max_tokens"] <= 4096:
        body["max_tokens"] = 4
    body.setdefault("max_tokens", 4)
    return json.dumps(body).encode()


@given(body=completion_bodies())
@FUZZ
def test_fuzz_http(cluster: LocalCluster, body: bytes) -> None:
    for server in (cluster.coordinator, cluster.aggregated):
        response = httpx.post(f"{server.http_url}/completions", content=body, timeout=CALL_TIMEOUT_S)
        assert response.status_code in CLEAN_HTTP, (
            server.name,
            response.status_code,
            response.text[:300],
            body[:300],
        )
        event(f"http {response.status_code}")
        if response.status_code != 200:
            assert response.json()["error"]["message"], response.text
