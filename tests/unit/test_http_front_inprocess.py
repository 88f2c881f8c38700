"""The HTTP front in this process over a scripted backend: status mapping, the in-flight bound,
the shutdown gate and a client that leaves. No model, no workers; uvicorn on a loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator

import grpc
import httpx
import pytest

from beamsplit.launch.launcher import PortPicker
from beamsplit.server.http_front import HttpServer, OpenAIFront
from beamsplit.server.metrics import ServerMetrics
from beamsplit.server.server_common import ShutdownGate
from beamsplit.v1 import common_pb2, coordinator_pb2
from beamsplit.wire import ServiceError
from engine.tokenizer import ByteTokenizer

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}


class ScriptedBackend:
    """Waits until released (or the client is gone), then answers one beam or raises `error`."""

    def __init__(self) -> None:
        self.error: ServiceError | None = None
        self.release = threading.Event()
        self.started = threading.Event()
        self.client_gone = threading.Event()  # the last call's
        self.num_client_gone = 0  # callbacks fired, over all calls

    def generate(
        self,
        request: coordinator_pb2.GenerateRequest,
        time_remaining: Callable[[], float | None],
        on_client_gone: Callable[[Callable[[], None]], None],
    ) -> Generator[common_pb2.GenerateResponse, None, None]:
        client_gone = self.client_gone = threading.Event()

        def gone() -> None:
            self.num_client_gone += 1
            client_gone.set()

        on_client_gone(gone)
        self.started.set()
        while not (self.release.wait(0.01) or client_gone.is_set()):
            pass
        if client_gone.is_set():
            raise ServiceError(grpc.StatusCode.CANCELLED, "request cancelled by the client")
        if self.error is not None:
            raise self.error
        delta = common_pb2.Delta(beams=[common_pb2.TokenIds(token_ids=[104, 105])], texts=["hi"])
        yield common_pb2.GenerateResponse(delta=delta)
        beam = common_pb2.Beam(
            token_ids=[104, 105], text="hi", cumulative_logprob=-1.5, finish_reason="length"
        )
        stats = common_pb2.RequestStats(prompt_tokens=2)
        yield common_pb2.GenerateResponse(final=common_pb2.FinalResult(beams=[beam], stats=stats))


class Front:
    def __init__(self, max_in_flight: int) -> None:
        self.backend = ScriptedBackend()
        self.gate = ShutdownGate()
        front = OpenAIFront(
            self.backend, ByteTokenizer(), "tiny", 4096, self.gate, ServerMetrics("test"), "test server",
            max_in_flight=max_in_flight,
        )  # fmt: skip
        self.server = HttpServer(front.build_app(), "127.0.0.1", PortPicker().pick())
        self.url = f"http://127.0.0.1:{self.server.port}/v1/completions"


@pytest.fixture
def front() -> Iterator[Front]:
    started = Front(max_in_flight=1)
    started.server.start()
    try:
        yield started
    finally:
        started.backend.release.set()
        started.server.stop()


def test_answers_once_released(front: Front) -> None:
    front.backend.release.set()
    response = httpx.post(front.url, json=BODY, timeout=10.0)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["cumulative_logprob"]) == ("hi", [104, 105], -1.5)


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "server_overloaded"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
        (grpc.StatusCode.INTERNAL, 500, "internal_error"),
    ],
)
def test_grpc_status_maps_to_http(front: Front, code: grpc.StatusCode, status: int, error_type: str) -> None:
    front.backend.error = ServiceError(code, "test server: it went wrong")
    front.backend.release.set()
    for stream in (False, True):  # an error before the first token keeps its status when streaming
        response = httpx.post(front.url, json={**BODY, "stream": stream}, timeout=10.0)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["type"] == error_type and "it went wrong" in error["message"]
        assert error["code"] == (None if status == 400 else code.name.lower())
    assert front.backend.num_client_gone == 0  # a finished call is never cancelled afterwards


def test_requests_beyond_the_bound_get_429(front: Front) -> None:
    results: list[httpx.Response] = []
    first = threading.Thread(target=lambda: results.append(httpx.post(front.url, json=BODY, timeout=10.0)))
    first.start()
    assert front.backend.started.wait(5.0)
    refused = httpx.post(front.url, json=BODY, timeout=10.0)
    assert refused.status_code == 429
    assert "too many HTTP requests in flight" in refused.json()["error"]["message"]
    front.backend.release.set()
    first.join(10.0)
    assert [result.status_code for result in results] == [200]
    assert httpx.post(front.url, json=BODY, timeout=10.0).status_code == 200  # the slot came back
    assert front.backend.num_client_gone == 0


def test_a_draining_server_answers_503(front: Front) -> None:
    assert front.gate.drain(0.0)
    response = httpx.post(front.url, json=BODY, timeout=10.0)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "test server: server shutting down"


def test_a_client_that_leaves_fires_on_client_gone(front: Front) -> None:
    with pytest.raises(httpx.TimeoutException):
        httpx.post(front.url, json=BODY, timeout=0.5)
    assert front.backend.client_gone.wait(5.0)
    deadline = time.monotonic() + 5.0
    while front.gate.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert front.gate.num_in_flight == 0


def test_stop_ends_the_server_within_its_bound() -> None:
    front = Front(max_in_flight=4)
    front.server.start()
    front.backend.release.set()
    assert httpx.get(front.url.replace("/completions", "/models"), timeout=5.0).status_code == 200
    started = time.monotonic()
    front.server.stop()
    assert time.monotonic() - started < 5.0
    with pytest.raises(httpx.ConnectError):
        httpx.get(front.url.replace("/completions", "/models"), timeout=1.0)


def test_unknown_route_and_wrong_method_answer_in_the_openai_shape(front: Front) -> None:
    missing = httpx.post(front.url.replace("/completions", "/embeddings"), json={}, timeout=5.0)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "POST /v1/embeddings: Not Found"
    wrong = httpx.get(front.url, timeout=5.0)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
