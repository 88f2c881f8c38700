"""What tools look for on the HTTP port beside the OpenAI routes: /health, /v1/models/{id},
/tokenize, /detokenize (vLLM's shapes) and /metrics. In this process over a scripted backend."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from beamsplit.launch.launcher import PortPicker
from beamsplit.server.http_front import HttpServer, OpenAIFront
from beamsplit.server.metrics import ServerMetrics, read_samples
from beamsplit.server.server_common import ShutdownGate
from engine.tokenizer import ByteTokenizer
from tests.unit.test_http_front_inprocess import ScriptedBackend


class ToolFront:
    def __init__(self) -> None:
        self.gate = ShutdownGate()
        self.metrics = ServerMetrics("test")
        self.unready: str | None = None
        front = OpenAIFront(
            ScriptedBackend(), ByteTokenizer(), "tiny", 4096, self.gate, self.metrics, "test server",
            unready_reason=lambda: self.unready,
        )  # fmt: skip
        self.server = HttpServer(front.build_app(), "127.0.0.1", PortPicker().pick())
        self.base = f"http://127.0.0.1:{self.server.port}"


@pytest.fixture
def front() -> Iterator[ToolFront]:
    started = ToolFront()
    started.server.start()
    try:
        yield started
    finally:
        started.server.stop()


def test_health_follows_the_backend_and_the_drain(front: ToolFront) -> None:
    assert httpx.get(f"{front.base}/health", timeout=10.0).status_code == 200
    front.unready = "no healthy generation worker"
    response = httpx.get(f"{front.base}/health", timeout=10.0)
    assert response.status_code == 503 and "no healthy generation worker" in response.json()["reason"]
    front.unready = None
    assert front.gate.drain(0.1)
    response = httpx.get(f"{front.base}/health", timeout=10.0)
    assert response.status_code == 503 and "draining" in response.json()["reason"]


def test_one_model_by_id_and_404_naming_an_unknown_one(front: ToolFront) -> None:
    card = httpx.get(f"{front.base}/v1/models/tiny", timeout=10.0).json()
    assert (card["id"], card["object"], card["max_model_len"]) == ("tiny", "model", 4096)
    response = httpx.get(f"{front.base}/v1/models/org/other-model", timeout=10.0)
    assert response.status_code == 404
    error = response.json()["error"]
    assert "'org/other-model'" in error["message"] and error["param"] == "model"


def test_tokenize_and_detokenize_in_vllms_shapes(front: ToolFront) -> None:
    body = {"model": "tiny", "prompt": "hé", "return_token_strs": True}
    answer = httpx.post(f"{front.base}/tokenize", json=body, timeout=10.0).json()
    # ByteTokenizer: one id per UTF-8 byte; strings in GPT-2's byte alphabet, as the export spells them.
    assert answer == {
        "count": 3,
        "max_model_len": 4096,
        "tokens": [104, 195, 169],
        "token_strs": ["h", "Ã", "©"],
    }
    plain = httpx.post(f"{front.base}/tokenize", json={"prompt": "ab"}, timeout=10.0).json()
    assert plain["tokens"] == [97, 98] and plain["token_strs"] is None
    back = httpx.post(
        f"{front.base}/detokenize", json={"model": "tiny", "tokens": [104, 195, 169, 257]}, timeout=10.0
    )
    assert back.json() == {"prompt": "hé"}  # special tokens (257: eos) decode to nothing


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "chat_template": "x"}, "chat_template"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # tiny: no template
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 260]}, "tokens"),
        ("/detokenize", {"tokens": "ab"}, "tokens"),
    ],
)
def test_bad_bodies_get_400_naming_the_field(
    front: ToolFront, path: str, body: dict[str, object], param: str
) -> None:
    response = httpx.post(f"{front.base}{path}", json=body, timeout=10.0)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_metrics_on_the_http_port_are_the_servers_registry(front: ToolFront) -> None:
    front.metrics.count_request("ok")
    front.metrics.count_request("ok")
    response = httpx.get(f"{front.base}/metrics", timeout=10.0)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert read_samples(response.text, "beamsplit_requests_total")['outcome="ok"'] == 2.0
