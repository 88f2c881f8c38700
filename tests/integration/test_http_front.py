"""The OpenAI-compatible HTTP front, driven with the official `openai` client as users drive it.

The module's deployment (tests/helpers/http_front.py: `tiny`, float64, the front on the
coordinator and on the aggregated server). Beam-search choices must equal the gRPC result of the
same request token for token and score for score; every refusal names its field; every test ends
with every KV pool back to zero blocks in use. A last test starts SmolLM2 for one chat completion.
Stop strings: test_http_stop_strings.py; log-probs: test_http_logprobs.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ProcessGroup, ServerProcess
from beamsplit.launch.local_cluster import DEFAULT_ENGINE_ARGUMENTS, LocalCluster
from beamsplit.v1 import common_pb2
from engine.models.loader import load_model_tokenizer
from tests.helpers.http_front import (
    MODEL,
    SERVERS,
    assert_choices_equal_beams,
    assert_pools_empty,
    client_of,
    grpc_beams,
    http_cluster,
    prompt_ids,
    serve_each,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from http_cluster(tmp_path_factory, "http-front")


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[ServerProcess]:
    yield from serve_each(request, cluster)


def test_models(server: ServerProcess) -> None:
    models = client_of(server).models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].owned_by == "beamsplit"


def test_what_tools_look_for_on_the_same_port(server: ServerProcess) -> None:
    """/health, /v1/models/{id}, /tokenize, /detokenize and /metrics beside the OpenAI routes."""
    base = server.http_url.removesuffix("/v1")
    assert httpx.get(f"{base}/health", timeout=10.0).json() == {"status": "serving"}
    assert httpx.get(f"{server.http_url}/models/{MODEL}", timeout=10.0).json()["id"] == MODEL
    missing = httpx.get(f"{server.http_url}/models/llama-70b", timeout=10.0)
    assert missing.status_code == 404 and "'llama-70b'" in missing.json()["error"]["message"]
    text = "count these tokens, with ünïcode"
    counted = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text}, timeout=10.0).json()
    completion = client_of(server).completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    assert completion.usage is not None and counted["count"] == completion.usage.prompt_tokens
    back = httpx.post(f"{base}/detokenize", json={"tokens": counted["tokens"]}, timeout=10.0).json()
    assert back == {"prompt": text}
    page = httpx.get(f"{base}/metrics", timeout=10.0).text  # the metrics port's registry, same numbers
    ok = 'beamsplit_requests_total{outcome="ok"}'
    assert requests_by_outcome(server, "ok") == float(
        next(line for line in page.splitlines() if line.startswith(ok)).split()[-1]
    )


@pytest.mark.parametrize(("n", "best_of"), [(3, None), (2, 4)])
def test_beam_search_equals_grpc(server: ServerProcess, n: int, best_of: int | None) -> None:
    token_ids = prompt_ids(40, seed=n)
    extra: dict[str, Any] = {"use_beam_search": True}
    if best_of is not None:
        extra["best_of"] = best_of
    result = client_of(server).completions.create(
        model=MODEL, prompt=token_ids, max_tokens=8, n=n, extra_body=extra
    )
    beams = grpc_beams(server, token_ids, beam_width=best_of or n, max_new_tokens=8)
    assert_choices_equal_beams(result.choices, beams[:n])
    assert result.usage is not None
    assert result.usage.prompt_tokens == 40
    assert result.usage.completion_tokens == sum(len(beam.token_ids) for beam in beams[:n])


def test_best_of_with_temperature_zero_is_beam_search(server: ServerProcess) -> None:
    token_ids = prompt_ids(33, seed=5)
    result = client_of(server).completions.create(
        model=MODEL, prompt=token_ids, max_tokens=6, n=2, temperature=0, extra_body={"best_of": 3}
    )
    assert_choices_equal_beams(result.choices, grpc_beams(server, token_ids, 3, 6)[:2])


def test_beam_search_streamed(server: ServerProcess) -> None:
    token_ids = prompt_ids(40, seed=9)
    client = client_of(server)
    whole = client.completions.create(
        model=MODEL, prompt=token_ids, max_tokens=8, n=2, extra_body={"use_beam_search": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=token_ids,
            max_tokens=8,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"use_beam_search": True},
        )
    )
    # Beams are decided at the end: one chunk per returned beam, best first, then the usage.
    streamed = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert [choice.index for choice in streamed] == [0, 1]
    for choice, expected in zip(streamed, whole.choices, strict=True):
        assert choice.text == expected.text
        assert choice.token_ids == expected.token_ids  # type: ignore[attr-defined]
        assert choice.finish_reason == expected.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens  # type: ignore[union-attr]


def test_greedy_text_streamed_and_not(server: ServerProcess) -> None:
    prompt = "The quick brown fox"
    client = client_of(server)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    with BeamsplitClient(server.address) as grpc_client:
        sampling = common_pb2.SamplingOptions(max_new_tokens=12)
        reference = grpc_client.generate(build_request(prompt=prompt, sampling=sampling), timeout_s=120.0)
    assert whole.choices[0].token_ids == reference.beams[0].token_ids  # type: ignore[attr-defined]
    assert whole.choices[0].text == reference.texts[0]
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    )
    assert len(chunks) >= 2  # text arrives as it is decided, not all at the end
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == whole.choices[0].finish_reason


BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("max_tokens -1", {"max_tokens": -1}, "max_tokens"),  # 0 is valid: score the prompt only
    ("max_tokens huge", {"max_tokens": 100_000}, "max_tokens"),
    ("max_tokens not an int", {"max_tokens": "8"}, "max_tokens"),
    ("n without beams", {"n": 2}, "n"),
    ("n above best_of", {"n": 3, "extra_body": {"use_beam_search": True, "best_of": 2}}, "n"),
    ("best_of 65", {"temperature": 0, "extra_body": {"best_of": 65}}, "best_of"),
    (
        "beams with temperature",
        {"n": 2, "temperature": 0.7, "extra_body": {"use_beam_search": True}},
        "temperature",
    ),
    ("negative temperature", {"temperature": -1.0}, "temperature"),
    ("top_p 0", {"top_p": 0.0}, "top_p"),
    ("stop string too long", {"stop": ["x" * 129]}, "stop"),
    ("two stop token ids", {"extra_body": {"stop_token_ids": [1, 2]}}, "stop_token_ids"),
    ("stop token id outside vocab", {"extra_body": {"stop_token_ids": [999]}}, "stop_token_ids"),
    ("logprobs over 20", {"logprobs": 21}, "logprobs"),
    ("early_stopping", {"extra_body": {"use_beam_search": True, "early_stopping": "soon"}}, "early_stopping"),
    ("unknown token id", {"prompt": [1, 2, 260]}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("prompt too long", {"prompt": [1] * 4090, "max_tokens": 16}, "prompt"),
    ("unknown model", {"model": "gpt-4"}, "model"),
    ("unknown field", {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ("presence penalty", {"presence_penalty": 0.5}, "presence_penalty"),
]


@pytest.mark.parametrize(("case", "fields", "param"), BAD_FIELDS, ids=[case for case, _, _ in BAD_FIELDS])
def test_bad_field_is_400_naming_it(
    server: ServerProcess, case: str, fields: dict[str, Any], param: str
) -> None:
    arguments: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client_of(server).completions.create(**arguments)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]
    assert error["code"] is None


def test_bad_field_is_400_when_streaming_too(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client_of(server).completions.create(model=MODEL, prompt="hello", max_tokens=-1, stream=True)
    assert raised.value.body["param"] == "max_tokens"  # type: ignore[index]


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (json.dumps({"model": MODEL, "prompt": 5}).encode(), "prompt"),
        (json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}).encode(), "stream"),
        (json.dumps({"model": MODEL, "prompt": "hi", "n": 1.5}).encode(), "n"),
    ],
)
def test_malformed_body_is_400(server: ServerProcess, content: bytes, param: str | None) -> None:
    response = httpx.post(f"{server.http_url}/completions", content=content, timeout=30.0)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_chat_without_template_is_400(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client_of(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "messages"
    assert "no chat template" in error["message"]


def test_full_server_is_429(cluster: LocalCluster) -> None:
    # The context worker's 4 pages cannot hold a 200-token prompt; the aggregated server's 64 pages
    # cannot hold 2100 tokens. Both say RESOURCE_EXHAUSTED, which is 429, streamed or not.
    cases = [(cluster.coordinator, 200, "context worker"), (cluster.aggregated, 2100, "aggregated server")]
    for server, length, who in cases:
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as raised:
                client_of(server).completions.create(
                    model=MODEL,
                    prompt=prompt_ids(length, seed=1),
                    max_tokens=8,
                    n=4,
                    stream=stream,
                    extra_body={"use_beam_search": True},
                )
            error = raised.value.body
            assert isinstance(error, dict), error
            assert error["code"] == "resource_exhausted" and who in error["message"], error
    assert_pools_empty(cluster)


def requests_by_outcome(server: ServerProcess, outcome: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5.0) as page:
        text = page.read().decode()
    match = re.search(rf'^beamsplit_requests_total{{outcome="{outcome}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def metric_value(server: ServerProcess, series: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5.0) as page:
        text = page.read().decode()
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_http_requests_are_measured_like_grpc_ones(server: ServerProcess) -> None:
    """The HTTP front runs the servicer's request loop: latencies, outcome and request-id logs."""
    series = ("beamsplit_time_to_first_token_seconds_count", "beamsplit_e2e_latency_seconds_count")
    before = {name: metric_value(server, name) for name in series}
    ok_before = requests_by_outcome(server, "ok")
    client_of(server).completions.create(
        model=MODEL, prompt="measured", max_tokens=4, n=2, extra_body={"use_beam_search": True}
    )
    assert all(metric_value(server, name) == before[name] + 1 for name in series)
    assert requests_by_outcome(server, "ok") == ok_before + 1
    assert re.search(r"request_id=[0-9a-f]{32}: finished: prompt_tokens=8 ", server.log_tail(200)) is not None


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_client_gone_cancels_the_request(server: ServerProcess, stream: bool) -> None:
    cancelled_before = requests_by_outcome(server, "cancelled")
    body = {
        "model": MODEL,
        "prompt": "a long answer",
        "max_tokens": 1900,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        chunks = client_of(server).completions.create(
            model=MODEL,
            prompt="a long answer",
            max_tokens=1900,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for index, _ in enumerate(chunks):
            if index == 2:
                break
        chunks.close()  # the client goes away with ~1900 tokens still to decode
    else:
        with pytest.raises(httpx.TimeoutException):  # gives up long before 1900 tokens are decoded
            httpx.post(f"{server.http_url}/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10.0
    while requests_by_outcome(server, "cancelled") == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests_by_outcome(server, "cancelled") == cancelled_before + 1
    # `server`'s teardown then checks that every pool is back to zero blocks in use.


def test_sigterm_drains_http_then_exits_cleanly(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    try:
        arguments = [*DEFAULT_ENGINE_ARGUMENTS, "--shutdown-grace-s", "2"]
        server = group.start("aggregated", "aggregated", arguments, http=True)
        group.wait_healthy(server, 120.0)
        client = client_of(server)
        chunks = iter(
            client.completions.create(
                model=MODEL,
                prompt="a long answer",
                max_tokens=3000,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        next(chunks)
        os.kill(server.pid, signal.SIGTERM)
        # While the stream drains, new requests are refused with 503 by the same shutdown gate.
        deadline = time.monotonic() + 10.0
        status = None
        while status != 503 and time.monotonic() < deadline:
            try:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=0)
            except openai.APIStatusError as error:
                status = error.status_code
                assert status == 503 and "server shutting down" in error.message, error
        assert status == 503
        # Past --shutdown-grace-s the in-flight stream ends with an error event, then the process exits 0.
        with pytest.raises(openai.APIError, match="server shutting down"):
            for _ in chunks:
                pass
        assert server.process.wait(timeout=30.0) == 0
        assert "blocks in use at exit: 0" in server.log_tail(5)
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    group = ProcessGroup(tmp_path_factory.mktemp("http-front-smollm2"))
    try:
        server = group.start("aggregated", "aggregated", ["--model", "smollm2-135m"], http=True)
        group.wait_healthy(server, 180.0)
        yield server
    finally:
        codes = group.stop_all()
    assert codes == {"aggregated": 0}, codes


def test_chat_renders_the_model_template(smollm2: ServerProcess) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    client = client_of(smollm2)
    chat = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=8, temperature=0
    )  # type: ignore[arg-type]
    tokenizer = load_model_tokenizer("smollm2-135m")
    assert tokenizer.chat_template is not None
    rendered = tokenizer.chat_template.render(messages)
    assert rendered.startswith("<|im_start|>")
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tokenizer.encode(rendered))
    # The same prompt as a completion gives the same answer: the chat rendered it exactly so.
    completion = client.completions.create(
        model="smollm2-135m", prompt=tokenizer.encode(rendered), max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    assert "Paris" in (chat.choices[0].message.content or "")
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == chat.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_tokenize_counts_the_chat_prompt_as_chat_completions_do(smollm2: ServerProcess) -> None:
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    base = smollm2.http_url.removesuffix("/v1")
    counted = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=30.0).json()
    chat = client_of(smollm2).chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=1, temperature=0
    )  # type: ignore[arg-type]
    assert chat.usage is not None and counted["count"] == chat.usage.prompt_tokens
    assert counted["max_model_len"] == 8192 and counted["token_strs"] is None
