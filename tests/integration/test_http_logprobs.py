"""Generated tokens' log-probs through the HTTP front of both deployments, with the official
`openai` client: completions `logprobs` k, chat `logprobs`/`top_logprobs`, streamed and not.

The deployment serves a random float64 Llama with a real tokenizer and a chat template (block 16),
so every number can be checked against transformers' `log_softmax` of the same forward pass to
1e-9: greedy, sampling and each beam of a beam search, the second time with the prompt's prefix
cached. The coordinator (the context worker ships the first token's candidates, the generation
worker the rest) must answer exactly what the aggregated server answers. A streamed response
carries each token's log-prob once, in the chunk that carries the token, and all of them equal
the unstreamed response's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from beamsplit.launch.launcher import ServerProcess
from beamsplit.launch.local_cluster import LocalCluster
from engine.tokenizer import Tokenizer, load_tokenizer
from tests.helpers.checkpoints import write_random_llama_with_tokenizer
from tests.helpers.clusters import assert_pools_empty, module_cluster
from tests.helpers.http_front import SERVERS, client_of, serve_each

TOLERANCE = 1e-9
BLOCK = 16
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "the quick brown fox jumps over the lazy dog and then"
MESSAGES = [{"role": "user", "content": "tell me about the quick brown fox"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-chat")
    return write_random_llama_with_tokenizer(directory, seed=6, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    yield from module_cluster(
        tmp_path_factory,
        "http-logprobs",
        engine_arguments=["--model", str(model_dir), "--dtype", "float64", "--tokens-per-block", str(BLOCK)],
        http=True,
    )


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, cluster: LocalCluster) -> Iterator[ServerProcess]:
    yield from serve_each(request, cluster)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return load_tokenizer(model_dir, None, None)  # the servers' own


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """token ids -> [len, V] transformers' float64 log_softmax of one forward pass over them."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0], dim=-1)

    return logprobs


def expected_top(tokenizer: Tokenizer, row: torch.Tensor, num_top: int) -> list[tuple[str, float]]:
    values, indices = torch.topk(row, k=num_top)
    return [
        (tokenizer.decode([index]), value)
        for index, value in zip(indices.tolist(), values.tolist(), strict=True)
    ]


def check_completion_choice(
    choice: Any, prompt_ids: list[int], num_top: int, tokenizer: Tokenizer, reference: Any
) -> None:
    token_ids: list[int] = choice.token_ids
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.token_logprobs) == len(token_ids) > 0
    rows = reference(prompt_ids + token_ids)
    for index, token_id in enumerate(token_ids):
        row = rows[len(prompt_ids) + index - 1]
        assert logprobs.tokens[index] == tokenizer.decode([token_id])
        assert abs(logprobs.token_logprobs[index] - float(row[token_id])) <= TOLERANCE
        # Ids decoding to one string (a byte of a split character reads U+FFFD) keep the better.
        expected: dict[str, float] = {}
        for text, value in expected_top(tokenizer, row, num_top):
            expected.setdefault(text, value)
        expected.setdefault(tokenizer.decode([token_id]), float(row[token_id]))  # the chosen joins
        top = logprobs.top_logprobs[index]
        assert top.keys() == expected.keys()
        assert all(abs(top[text] - value) <= TOLERANCE for text, value in expected.items())
    # The decoders' own float32 sum, to ~1e-5 of the float64 records' sum.
    assert abs(sum(logprobs.token_logprobs) - choice.cumulative_logprob) <= 1e-4


COMPLETIONS = [
    {"max_tokens": 6, "temperature": 0, "logprobs": 3},
    {"max_tokens": 6, "temperature": 0.9, "seed": 11, "logprobs": 0},
    {"max_tokens": 5, "n": 3, "logprobs": 2, "extra_body": {"use_beam_search": True}},
]


def reused_tokens(process: ServerProcess) -> float:
    """Prompt tokens the process found in its prefix tree so far (its metrics page)."""
    series = re.findall(
        r"^beamsplit_prefix_reused_tokens_total\{[^}]*\} (\S+)$", process.metrics_text(), re.M
    )
    return sum(float(value) for value in series)


@pytest.mark.parametrize("fields", COMPLETIONS, ids=["greedy", "sampling", "beam-3"])
def test_completion_logprobs_equal_transformers(
    server: ServerProcess,
    cluster: LocalCluster,
    fields: dict[str, Any],
    tokenizer: Tokenizer,
    reference: Any,
) -> None:
    client = client_of(server)
    extra = {"ignore_eos": True, **fields.get("extra_body", {})}
    arguments = {**fields, "extra_body": extra}
    prompt_ids = tokenizer.encode(PROMPT)
    num_cached = (len(prompt_ids) - 1) // BLOCK * BLOCK  # what the second request finds cached
    assert num_cached > 0
    prefilling = cluster.aggregated if server is cluster.aggregated else cluster.context
    reused_before = reused_tokens(prefilling)
    answers = [
        client.completions.create(model=server_model(server), prompt=PROMPT, **arguments) for _ in range(2)
    ]
    assert reused_tokens(prefilling) - reused_before >= num_cached
    assert answers[0].choices == answers[1].choices  # cold or with the prefix cached, the same numbers
    assert len(answers[0].choices) == fields.get("n", 1)
    for choice in answers[0].choices:
        check_completion_choice(choice, prompt_ids, fields["logprobs"], tokenizer, reference)


@pytest.mark.parametrize(
    "fields", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "sampling"]
)
def test_chat_logprobs_equal_transformers(
    server: ServerProcess, fields: dict[str, Any], tokenizer: Tokenizer, reference: Any
) -> None:
    chat = client_of(server).chat.completions.create(
        model=server_model(server),
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        **fields,
    )
    assert chat.choices[0].message.role == "assistant"
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    template = tokenizer.chat_template
    assert template is not None
    prompt_ids = tokenizer.encode(template.render(MESSAGES))
    token_ids: list[int] = chat.choices[0].token_ids  # type: ignore[attr-defined]
    assert len(content) == len(token_ids) == 6
    rows = reference(prompt_ids + token_ids)
    for index, (entry, token_id) in enumerate(zip(content, token_ids, strict=True)):
        row = rows[len(prompt_ids) + index - 1]
        assert entry.token == tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert abs(entry.logprob - float(row[token_id])) <= TOLERANCE
        expected = expected_top(tokenizer, row, 3)
        assert [alternative.token for alternative in entry.top_logprobs] == [text for text, _ in expected]
        for alternative, (_, value) in zip(entry.top_logprobs, expected, strict=True):
            assert abs(alternative.logprob - value) <= TOLERANCE


def test_streamed_logprobs_equal_the_whole_response(server: ServerProcess) -> None:
    client = client_of(server)
    model = server_model(server)
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(prompt=PROMPT, logprobs=2, **common).choices[0]
    chunks = list(client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **common))
    carrying = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].logprobs]
    assert len(carrying) >= 4  # log-probs arrive with their tokens, not all at the end
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in carrying:
        logprobs = choice.logprobs
        assert logprobs is not None
        for name, values in merged.items():
            values.extend(getattr(logprobs, name))
    assert whole.logprobs is not None
    assert merged == {name: getattr(whole.logprobs, name) for name in merged}
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.text
    chat_whole = client.chat.completions.create(
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=2,
        **common,  # type: ignore[arg-type]
    ).choices[0]
    chat_chunks = list(
        client.chat.completions.create(
            messages=MESSAGES,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **common,  # type: ignore[arg-type]
        )
    )
    streamed = [
        entry
        for chunk in chat_chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert chat_whole.logprobs is not None and streamed == chat_whole.logprobs.content
    # Beam search decides its beams at the end: each beam's chunk carries all its records.
    beams: dict[str, Any] = {
        **common,
        "n": 2,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True, "use_beam_search": True},
    }
    beams.pop("temperature")
    whole_beams = client.completions.create(prompt=PROMPT, **beams).choices
    beam_chunks = [
        chunk.choices[0]
        for chunk in client.completions.create(prompt=PROMPT, stream=True, **beams)
        if chunk.choices
    ]
    assert len(whole_beams) == 2 and all(choice.logprobs is not None for choice in whole_beams)
    assert [choice.logprobs for choice in beam_chunks] == [choice.logprobs for choice in whole_beams]
    assert sum(1 for chunk in chat_chunks if chunk.choices and chunk.choices[0].logprobs) >= 4


def test_echo_with_stream_stays_refused_and_max_tokens_0_streams_nothing(server: ServerProcess) -> None:
    client = client_of(server)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=server_model(server), prompt=PROMPT, max_tokens=2, echo=True, logprobs=1, stream=True
        )
    assert raised.value.body["param"] == "echo"  # type: ignore[index]
    # max_tokens 0: the one token the engine decides (with the prefill, so no delta) is dropped.
    chunks = list(
        client.completions.create(
            model=server_model(server), prompt=PROMPT, max_tokens=0, logprobs=1, stream=True
        )
    )
    assert [chunk.choices[0].text for chunk in chunks] == [""]
    assert chunks[0].choices[0].logprobs is not None and chunks[0].choices[0].logprobs.tokens == []


def test_both_deployments_answer_the_same_numbers(cluster: LocalCluster) -> None:
    """The coordinator's answers (first token from the context worker's candidates) equal the
    aggregated server's exactly, streamed or not."""
    answers = []
    for server in (cluster.aggregated, cluster.coordinator):
        client = client_of(server)
        model = server_model(server)
        common: dict[str, Any] = {"model": model, "max_tokens": 5, "extra_body": {"ignore_eos": True}}
        completion = client.completions.create(
            prompt=PROMPT,
            logprobs=4,
            n=2,
            **{**common, "extra_body": {"ignore_eos": True, "use_beam_search": True}},
        )
        chat = client.chat.completions.create(
            messages=MESSAGES,
            logprobs=True,
            top_logprobs=4,
            temperature=0.7,
            seed=3,
            **common,  # type: ignore[arg-type]
        )
        streamed = [
            chunk.choices[0].logprobs
            for chunk in client.completions.create(
                prompt=PROMPT, logprobs=1, temperature=0, stream=True, **common
            )
            if chunk.choices
        ]
        answers.append(
            (
                [choice.model_dump() for choice in completion.choices],
                [choice.model_dump() for choice in chat.choices],
                [logprobs.model_dump() if logprobs else None for logprobs in streamed],
            )
        )
    assert answers[0] == answers[1]
    assert_pools_empty(cluster)


def server_model(server: ServerProcess) -> str:
    return client_of(server).models.list().data[0].id
