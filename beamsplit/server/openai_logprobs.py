"""Per-token log-probs in OpenAI's JSON shapes: the completions API's `logprobs` object (with
`echo`, the prompt's positions first) and chat's `logprobs.content` list.

Completions (OpenAI's legacy API, as vLLM returns it):
    {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
     "text_offset": [int]}
Position i's token is `tokens[i]`; the first prompt token has no log-prob (null, and a null top
entry). `top_logprobs[i]` holds the position's best k tokens plus the chosen one when it is not
among them (OpenAI: "up to logprobs+1 elements"). `text_offset[i]` is where token i's text starts
in the choice's `text` (each token decoded alone; the offsets add up those pieces' lengths).
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]},
the generated tokens only, exactly top_logprobs alternatives each.

Token strings are each id decoded alone, so two ids may share one string (a byte of a character
split across tokens decodes to U+FFFD); in a top_logprobs dict the better one then stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from beamsplit.v1 import common_pb2, coordinator_pb2
from engine.tokenizer import Tokenizer


def prompt_token_ids(request: coordinator_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt as the backend sees it (request_validation encodes text with the same tokenizer)."""
    if request.WhichOneof("prompt") == "text":
        return tokenizer.encode(request.text)
    return list(request.token_ids.token_ids)


def prompt_text(request: coordinator_pb2.GenerateRequest, tokenizer: Tokenizer) -> str:
    if request.WhichOneof("prompt") == "text":
        return request.text
    return tokenizer.decode(list(request.token_ids.token_ids))


def completion_logprobs(
    tokenizer: Tokenizer,
    first_token_id: int | None,
    records: Sequence[common_pb2.TokenLogprob],
    start_offset: int = 0,
) -> dict[str, Any]:
    """first_token_id: the echoed prompt's first token (no log-prob), or None without echo."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset = start_offset
    if first_token_id is not None:
        text = _token_text(tokenizer, first_token_id)
        tokens.append(text)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset.append(offset)
        offset += len(text)
    for record in records:
        text = _token_text(tokenizer, record.token_id)
        tokens.append(text)
        token_logprobs.append(record.logprob)
        top: dict[str, float] = {}
        for token_id, logprob in zip(record.top_token_ids, record.top_logprobs, strict=True):
            top.setdefault(_token_text(tokenizer, token_id), logprob)
        top.setdefault(text, record.logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(tokenizer: Tokenizer, records: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
    content = []
    for record in records:
        top = [
            _chat_entry(_token_text(tokenizer, token_id), logprob)
            for token_id, logprob in zip(record.top_token_ids, record.top_logprobs, strict=True)
        ]
        entry = _chat_entry(_token_text(tokenizer, record.token_id), record.logprob)
        entry["top_logprobs"] = top
        content.append(entry)
    return {"content": content}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])
