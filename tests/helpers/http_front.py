"""What the HTTP-front integration modules share: one deployment each (`tiny`, float64, block 32)
with the front on the coordinator and on the aggregated server, the `openai` client as users
drive it, the gRPC result of the same request, and the check that every KV pool is empty again.

The context worker has 4 pages (prompts of up to 128 tokens) and the aggregated server 64 (2048
tokens), so a long prompt is refused for lack of KV space."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from beamsplit.client.grpc_client import BeamsplitClient, build_request
from beamsplit.launch.launcher import ServerProcess
from beamsplit.launch.local_cluster import LocalCluster
from beamsplit.v1 import common_pb2
from engine.models.loader import load_model_tokenizer
from tests.helpers.clusters import assert_pools_empty, module_cluster

MODEL = "tiny"
CONTEXT_BLOCKS = 4  # a context worker holds prompts of up to 128 tokens
AGGREGATED_BLOCKS = 64  # 2048 tokens
SCORE_TOLERANCE = 1e-9
SERVERS = ["coordinator", "aggregated"]


def http_cluster(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[LocalCluster]:
    """For a module-scoped fixture: the deployment, stopped after the module; every process must
    exit cleanly."""
    yield from module_cluster(
        tmp_path_factory,
        name,
        context_arguments=["--num-blocks", str(CONTEXT_BLOCKS)],
        aggregated_arguments=["--num-blocks", str(AGGREGATED_BLOCKS)],
        http=True,
    )


def serve_each(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[ServerProcess]:
    """For a fixture parametrized over SERVERS: that front, then every pool back to empty."""
    yield getattr(cluster, request.param)
    assert_pools_empty(cluster)


def client_of(server: ServerProcess) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test as it reached the client.
    return openai.OpenAI(base_url=server.http_url, api_key="x", max_retries=0, timeout=120.0)


def prompt_ids(length: int, seed: int) -> list[int]:
    return [(seed * 31 + index * 7) % 256 for index in range(length)]


def grpc_beams(
    server: ServerProcess, token_ids: list[int], beam_width: int, max_new_tokens: int
) -> list[Any]:
    sampling = common_pb2.SamplingOptions(beam_width=beam_width, max_new_tokens=max_new_tokens)
    with BeamsplitClient(server.address) as client:
        return client.generate(build_request(token_ids=token_ids, sampling=sampling), timeout_s=120.0).beams


def assert_choices_equal_beams(choices: list[Any], beams: list[Any]) -> None:
    assert len(choices) == len(beams)
    for index, (choice, beam) in enumerate(zip(choices, beams, strict=True)):
        assert choice.index == index
        assert choice.token_ids == beam.token_ids, f"choice {index} tokens differ"
        assert choice.finish_reason == beam.finish_reason
        assert choice.cumulative_logprob == pytest.approx(beam.cumulative_logprob, abs=SCORE_TOLERANCE)
        assert choice.score == pytest.approx(beam.score, abs=SCORE_TOLERANCE)


def first_stop_token(token_ids: list[int], stop: str) -> int:
    """Index of the token after which the generated text first holds `stop` (whole-text decodes)."""
    tokenizer = load_model_tokenizer(MODEL)
    return next(end for end in range(len(token_ids)) if stop in tokenizer.decode(token_ids[: end + 1]))
