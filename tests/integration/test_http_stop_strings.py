"""Stop strings through the HTTP front of both deployments (tests/helpers/http_front.py): the text
is cut before the first stop string, streamed or not; the engine ends the sequence at the token
completing it (no further decode steps, `usage` counts the kept tokens); a stop string ends a beam
as eos does, and the choices equal the gRPC beams of the same request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ServerProcess
from beamsplit.launch.local_cluster import LocalCluster
from beamsplit.v1 import common_pb2
from tests.helpers.http_front import (
    MODEL,
    SERVERS,
    assert_choices_equal_beams,
    client_of,
    first_stop_token,
    http_cluster,
    prompt_ids,
    serve_each,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from http_cluster(tmp_path_factory, "http-stop-strings")


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[ServerProcess]:
    yield from serve_each(request, cluster)


def test_stop_string_cuts_the_text(server: ServerProcess) -> None:
    prompt = "stop strings"
    client = client_of(server)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full[4:6]
    expected = full[: full.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_ends_the_request_in_the_engine(server: ServerProcess) -> None:
    """The engine stops decoding at the stop string: the kept tokens, no more decode steps."""
    prompt, max_tokens = "stop strings", 48
    client = client_of(server)
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    full_ids: list[int] = free.token_ids  # type: ignore[attr-defined]
    assert len(full_ids) == max_tokens
    stop = free.text[5:7]
    kept = first_stop_token(full_ids, stop) + 1
    assert kept < max_tokens // 2
    cut = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free.text[: free.text.find(stop)]
    assert choice.token_ids == full_ids[:kept]  # type: ignore[attr-defined]
    assert cut.usage is not None and cut.usage.completion_tokens == kept
    # Over gRPC the same request shows the engine's own count of decode steps (the generation
    # worker's, disaggregated) and the beam's text with the stop string in it.
    sampling = common_pb2.SamplingOptions(max_new_tokens=max_tokens, ignore_eos=True, stop_strings=[stop])
    with BeamsplitClient(server.address) as grpc_client:
        result = grpc_client.generate(build_request(prompt=prompt, sampling=sampling), timeout_s=120.0)
    assert list(result.beams[0].token_ids) == full_ids[:kept]
    assert result.beams[0].finish_reason == "stop" and stop in result.texts[0]
    assert result.stats["decode_steps"] == kept


def test_stop_string_ends_beams(server: ServerProcess) -> None:
    token_ids = prompt_ids(40, seed=2)
    client = client_of(server)
    extra: dict[str, Any] = {"use_beam_search": True, "ignore_eos": True}
    free = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=10, n=3, extra_body=extra)
    stop = free.choices[0].text[3:5]
    result = client.completions.create(
        model=MODEL, prompt=token_ids, max_tokens=10, n=3, stop=stop, extra_body=extra
    )
    sampling = common_pb2.SamplingOptions(
        beam_width=3, max_new_tokens=10, ignore_eos=True, stop_strings=[stop]
    )
    with BeamsplitClient(server.address) as grpc_client:
        beams = grpc_client.generate(
            build_request(token_ids=token_ids, sampling=sampling), timeout_s=120.0
        ).beams
    assert_choices_equal_beams(result.choices, beams)
    stopped = [choice for choice in result.choices if choice.finish_reason == "stop"]
    assert stopped, f"no beam ended on {stop!r}"
    for choice in stopped:
        tokens: list[int] = choice.token_ids  # type: ignore[attr-defined]
        assert first_stop_token(tokens, stop) == len(tokens) - 1  # the beam ends at its completing token
        assert stop not in choice.text
    assert result.usage is not None
    assert result.usage.completion_tokens == sum(len(beam.token_ids) for beam in beams)
