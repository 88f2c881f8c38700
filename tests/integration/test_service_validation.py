"""Bad input, over both client fronts and at the workers: every case of issue 11's list is refused
up front with a status naming the field, changes no state (every KV pool stays at zero blocks in
use) and the server keeps serving. The coordinator and the aggregated server refuse with the
same message. One deployment (`tiny`, HTTP fronts on) for the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ServerProcess
from beamsplit.launch.local_cluster import LocalCluster
from beamsplit.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers.bad_input import GRPC_CASES, HTTP_CASES, TINY_VOCAB, GrpcCase, HttpCase
from tests.helpers.clusters import assert_pools_empty, module_cluster

GENERATE = "/beamsplit.v1.Coordinator/Generate"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from module_cluster(tmp_path_factory, "service-validation", http=True)


def assert_serving(server: ServerProcess) -> None:
    sampling = common_pb2.SamplingOptions(beam_width=2, max_new_tokens=2)
    with BeamsplitClient(server.address) as client:
        result = client.generate(build_request(prompt="still here", sampling=sampling), timeout_s=60.0)
    assert len(result.beams) == 2


def call_raw(address: str, wire: bytes) -> grpc.RpcError:
    """Sends `wire` as the request bytes, as a raw client would; returns the error it must get."""
    with grpc.insecure_channel(address) as channel:
        generate = channel.unary_stream(GENERATE)  # no serializer: the bytes go out as they are
        try:
            responses = list(generate(wire, timeout=30.0))
        except grpc.RpcError as error:
            return error
    raise AssertionError(f"accepted, answered {len(responses)} messages")


@pytest.mark.parametrize("case", GRPC_CASES, ids=[case.name for case in GRPC_CASES])
def test_grpc_bad_input(cluster: LocalCluster, case: GrpcCase) -> None:
    details = []
    for server in (cluster.coordinator, cluster.aggregated):
        error = call_raw(server.address, case.wire)
        assert error.code() == case.code, (server.name, error.code(), error.details())
        assert case.field in error.details(), (server.name, error.details())
        details.append(error.details())
    assert details[0] == details[1], "coordinator and aggregated server disagree"
    assert_pools_empty(cluster)


@pytest.mark.parametrize("case", HTTP_CASES, ids=[case.name for case in HTTP_CASES])
def test_http_bad_input(cluster: LocalCluster, case: HttpCase) -> None:
    for server in (cluster.coordinator, cluster.aggregated):
        response = httpx.post(f"{server.http_url}/completions", content=case.body, timeout=60.0)
        assert response.status_code == case.status, (server.name, response.text[:300])
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == case.param, error
        assert error["message"] and (case.param is None or case.param in error["message"]), error
    assert_pools_empty(cluster)


def test_fronts_still_serve_after_bad_input(cluster: LocalCluster) -> None:
    for server in (cluster.coordinator, cluster.aggregated):
        assert_serving(server)
        response = httpx.post(
            f"{server.http_url}/completions",
            json={"model": "tiny", "prompt": "ok", "max_tokens": 2},
            timeout=60.0,
        )
        assert response.status_code == 200, response.text
    assert_pools_empty(cluster)


def test_unknown_ids_in_cancel_release_heartbeat(cluster: LocalCluster) -> None:
    """Well-formed unknown ids answer false (the calls are idempotent); empty ids are refused."""
    with (
        grpc.insecure_channel(cluster.generation.address) as g_channel,
        grpc.insecure_channel(cluster.context.address) as c_channel,
    ):
        generation = worker_pb2_grpc.GenerationWorkerStub(g_channel)
        context = worker_pb2_grpc.ContextWorkerStub(c_channel)
        assert not generation.Cancel(worker_pb2.CancelRequest(request_id="nope"), timeout=10.0).cancelled
        assert not context.Release(worker_pb2.ReleaseRequest(transfer_id="nope"), timeout=10.0).released
        assert not context.Heartbeat(worker_pb2.HeartbeatRequest(transfer_id="nope"), timeout=10.0).alive
        empty_calls = [
            (lambda: generation.Cancel(worker_pb2.CancelRequest(), timeout=10.0), "request_id"),
            (lambda: context.Release(worker_pb2.ReleaseRequest(), timeout=10.0), "transfer_id"),
            (lambda: context.Heartbeat(worker_pb2.HeartbeatRequest(), timeout=10.0), "transfer_id"),
        ]
        for call, field in empty_calls:
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in raised.value.details()
    assert_pools_empty(cluster)
    assert_serving(cluster.coordinator)


PROMPT = list(range(40))  # two pages of 32


def bad_handoffs(good: worker_pb2.Handoff) -> list[tuple[str, worker_pb2.Handoff, str]]:
    def changed(**fields: object) -> worker_pb2.Handoff:
        handoff = worker_pb2.Handoff()
        handoff.CopyFrom(good)
        for name, value in fields.items():
            if isinstance(value, worker_pb2.PageLayout):
                handoff.layout.CopyFrom(value)
            elif isinstance(value, list):
                field = getattr(handoff, name)
                del field[:]
                field.extend(value)
            else:
                setattr(handoff, name, value)
        return handoff

    layout = worker_pb2.PageLayout()
    layout.CopyFrom(good.layout)
    layout.page_bytes += 8
    return [
        ("negative page", changed(page_ids=[0, -5]), "handoff.page_ids[1]"),
        ("page twice", changed(page_ids=[good.page_ids[0]] * 2), "handoff.page_ids"),
        ("too few pages", changed(page_ids=[good.page_ids[0]]), "handoff.prompt_len/page_ids"),
        ("layout disagrees", changed(layout=layout), "handoff.layout"),
        ("candidate outside vocab", changed(candidate_ids=[TINY_VOCAB]), "handoff.candidate_ids[0]"),
        ("candidates without logprobs", changed(candidate_logprobs=[]), "handoff.candidate_logprobs"),
        (
            "model logprobs of other candidates",
            changed(candidate_model_logprobs=[-0.5, -1.0]),
            "handoff.candidate_model_logprobs",
        ),
        (
            "model logprob above 0",
            changed(candidate_model_logprobs=[0.5]),
            "handoff.candidate_model_logprobs[0]",
        ),
        ("no transfer id", changed(transfer_id=""), "handoff.transfer_id"),
    ]


def test_bad_handoffs_at_the_generation_worker(cluster: LocalCluster) -> None:
    sampling = common_pb2.SamplingOptions(max_new_tokens=2)
    with (
        grpc.insecure_channel(cluster.generation.address) as g_channel,
        grpc.insecure_channel(cluster.context.address) as c_channel,
    ):
        generation = worker_pb2_grpc.GenerationWorkerStub(g_channel)
        context = worker_pb2_grpc.ContextWorkerStub(c_channel)

        def prefill(request_id: str) -> worker_pb2.Handoff:
            request = worker_pb2.PrefillRequest(
                request_id=request_id, prompt_token_ids=PROMPT, num_candidates=1
            )
            handoff = context.Prefill(request, timeout=60.0).handoff
            handoff.context_address = cluster.context.address
            return handoff

        def generate(
            handoff: worker_pb2.Handoff, prompt: list[int] = PROMPT
        ) -> list[common_pb2.GenerateResponse]:
            request = worker_pb2.GenerationRequest(
                handoff=handoff, prompt_token_ids=prompt, sampling=sampling
            )
            return list(generation.Generate(request, timeout=60.0))

        good = prefill("handoff-checks")
        for name, handoff, field in [
            *bad_handoffs(good),
            ("prompt outside vocab", good, "prompt_token_ids[39]"),
        ]:
            prompt = [*PROMPT[:-1], TINY_VOCAB] if name == "prompt outside vocab" else PROMPT
            with pytest.raises(grpc.RpcError) as raised:
                generate(handoff, prompt)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, raised.value.details())
            assert field in raised.value.details(), (name, raised.value.details())
        # Refused up front, none of them touched the hold: the real handoff still decodes.
        assert generate(good)[-1].HasField("final")

        # Pages past the holder's region: only the holder can tell; it refuses the pull by page.
        beyond = prefill("handoff-beyond")
        del beyond.page_ids[:]
        beyond.page_ids.extend([10**6, 10**6 + 1])
        with pytest.raises(grpc.RpcError) as raised:
            generate(beyond)
        assert raised.value.code() == grpc.StatusCode.ABORTED and "outside region" in raised.value.details()
        context.Release(worker_pb2.ReleaseRequest(transfer_id=beyond.transfer_id), timeout=10.0)
    assert_pools_empty(cluster)
    assert_serving(cluster.coordinator)


def test_extreme_but_valid_sampling_values_are_served(cluster: LocalCluster) -> None:
    """Found by the fuzz test: these once failed a whole engine step (and every request in it)."""
    cases = [
        common_pb2.SamplingOptions(temperature=1e-310, max_new_tokens=3, seed=1),  # subnormal
        common_pb2.SamplingOptions(temperature=1e308, max_new_tokens=3, seed=1),
        common_pb2.SamplingOptions(length_penalty=-16.0, max_new_tokens=3),
        common_pb2.SamplingOptions(length_penalty=16.0, beam_width=3, max_new_tokens=3),
    ]
    for server in (cluster.coordinator, cluster.aggregated):
        with BeamsplitClient(server.address) as client:
            for sampling in cases:
                result = client.generate(build_request(prompt="edge", sampling=sampling), timeout_s=60.0)
                assert result.beams, sampling
    assert_pools_empty(cluster)
