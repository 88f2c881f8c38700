"""The client API's `GenerateResponse`s -> OpenAI JSON: whole responses, stream chunks, error bodies.

Beam search decides its beams only at the end (live beams reorder and get dropped), so a streamed
beam-search request gets one chunk per returned beam after the search ends. A one-sequence
request (greedy or sampling) streams its text as tokens are decided, cut at the first stop string,
and with logprobs each chunk carries its tokens' records (`LogprobStream`, from `Delta.logprobs`).
Every choice carries beamsplit's extension fields `token_ids`, `cumulative_logprob` and `score`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from beamsplit.server.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_text,
    prompt_token_ids,
)
from beamsplit.server.openai_wire import CompletionRequest
from beamsplit.v1 import common_pb2
from engine.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"  # a multi-byte character whose remaining tokens are not decided yet

# gRPC status -> (HTTP status, OpenAI error type); anything else is 500.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "server_overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
INTERNAL_ERROR = (500, "internal_error")


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str  # "stop" | "length"
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    logprobs: dict[str, Any] | None = None  # OpenAI's shape (openai_logprobs), when asked

    def extension(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "cumulative_logprob": self.cumulative_logprob,
            "score": self.score,
        }


def final_choices(
    final: common_pb2.FinalResult,
    parsed: CompletionRequest,
    tokenizer: Tokenizer | None = None,
    prompt_index: int = 0,
    is_chat: bool = False,
) -> list[Choice]:
    """The best `n` beams of prompt `prompt_index`, best first (choice indices continue the earlier
    prompts'); a stop string cuts the one sequence's text. With a tokenizer: echo and logprobs."""
    choices = []
    request = parsed.all_requests[prompt_index]
    echo_text = prompt_text(request, tokenizer) if parsed.echo and tokenizer is not None else ""
    for index, beam in enumerate(final.beams[: parsed.num_choices]):
        text, finish_reason = beam.text, beam.finish_reason
        token_ids, generated = list(beam.token_ids), list(beam.logprobs)
        cumulative_logprob, score = beam.cumulative_logprob, beam.score
        if parsed.drops_generated:  # max_tokens 0: the one token decided is not part of the answer
            text, finish_reason, token_ids, generated = "", "length", [], []
            cumulative_logprob = score = 0.0  # of no generated token (the dropped one may be sampled)
        cut = first_stop(text, parsed.stop)
        if cut is not None:
            text, finish_reason = text[:cut], "stop"
        logprobs = None
        if parsed.num_logprobs is not None and tokenizer is not None:
            if is_chat:
                logprobs = chat_logprobs(tokenizer, generated)
            elif parsed.echo:
                first_token_id = prompt_token_ids(request, tokenizer)[0]
                logprobs = completion_logprobs(
                    tokenizer, first_token_id, [*final.prompt_logprobs, *generated]
                )
            else:
                logprobs = completion_logprobs(tokenizer, None, generated)
        choices.append(
            Choice(
                prompt_index * parsed.num_choices + index,
                echo_text + text,
                finish_reason,
                token_ids,
                cumulative_logprob,
                score,
                logprobs,
            )  # fmt: skip
        )
    return choices


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    found = [index for index in (text.find(string) for string in stop) if index >= 0]
    return min(found) if found else None


class TextStream:
    """One sequence's text as its tokens arrive: only text that is final is released.

    Held back: an incomplete multi-byte character, and the longest tail that could still become a
    stop string. Once a stop string appears, the text before it is the whole answer.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._token_ids: list[int] = []
        self._sent = ""
        self.is_stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        self._token_ids.extend(token_ids)
        text = self._tokenizer.decode(self._token_ids)
        if text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._release(text, is_final=False)

    def finish(self, text: str) -> str:
        """The rest of the final text (the beam's own decode, authoritative)."""
        return self._release(text, is_final=True)

    def _release(self, text: str, is_final: bool) -> str:
        if self.is_stopped or not text.startswith(self._sent):
            return ""  # a tokenizer whose decode is not prefix-stable: the final text decides
        cut = first_stop(text, self._stop)
        if cut is not None:
            self.is_stopped = True
            end = cut
        elif is_final:
            end = len(text)
        else:
            end = len(text) - _longest_stop_prefix_tail(text, self._stop)
        new_text = text[len(self._sent) : max(end, len(self._sent))]
        self._sent += new_text
        return new_text


def _longest_stop_prefix_tail(text: str, stop: Sequence[str]) -> int:
    longest = 0
    for string in stop:
        for length in range(min(len(string) - 1, len(text)), longest, -1):
            if string.startswith(text[-length:]):
                longest = length
                break
    return longest


class ResponseWriter:
    """Builds the JSON objects of one completion or chat completion, streamed or not."""

    def __init__(
        self,
        parsed: CompletionRequest,
        model_name: str,
        is_chat: bool,
        response_id: str,
        created: int,
        tokenizer: Tokenizer | None = None,
    ):
        """tokenizer: for echo and logprobs (without one they are left out)."""
        self._tokenizer = tokenizer
        self._parsed = parsed
        self._model_name = model_name
        self._is_chat = is_chat
        self._id = response_id
        self._created = created

    def response(self, finals: Sequence[common_pb2.FinalResult]) -> dict[str, Any]:
        """finals: one per prompt, in the request's order."""
        body = self._envelope("chat.completion" if self._is_chat else "text_completion")
        body["choices"] = []
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for prompt_index, final in enumerate(finals):
            choices = final_choices(final, self._parsed, self._tokenizer, prompt_index, self._is_chat)
            body["choices"].extend(self._full_choice(choice) for choice in choices)
            for name, count in usage(final, choices).items():
                totals[name] += count
        body["usage"] = totals
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        extension: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk; logprobs: the OpenAI object of this chunk's tokens (logprobs_of)."""
        body = self._envelope("chat.completion.chunk" if self._is_chat else "text_completion")
        choice: dict[str, Any] = {"index": index}
        if self._is_chat:
            choice["delta"] = {} if text is None else {"role": "assistant", "content": text}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        choice.update(extension or {})
        body["choices"] = [choice]
        return body

    def logprobs_of(
        self, records: Sequence[common_pb2.TokenLogprob], text_offset: int
    ) -> dict[str, Any] | None:
        """The records of some generated tokens in OpenAI's shape (None without a tokenizer);
        text_offset: where the first one starts in the choice's text (completions)."""
        if self._tokenizer is None:
            return None
        if self._is_chat:
            return chat_logprobs(self._tokenizer, records)
        return completion_logprobs(self._tokenizer, None, records, text_offset)

    def usage_chunk(self, final: common_pb2.FinalResult) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self._is_chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(final, final_choices(final, self._parsed))
        return body

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        body: dict[str, Any] = {"index": choice.index}
        if self._is_chat:
            body["message"] = {"role": "assistant", "content": choice.text}
        else:
            body["text"] = choice.text
        body["logprobs"] = choice.logprobs
        body["finish_reason"] = choice.finish_reason
        body.update(choice.extension())
        return body

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self._id, "object": kind, "created": self._created, "model": self._model_name}


def usage(final: common_pb2.FinalResult, choices: Sequence[Choice]) -> dict[str, int]:
    """Tokens of the returned choices as the engine kept them: a stop string ended each sequence at
    the token completing it, which is counted though the text is cut before the stop string."""
    completion_tokens = sum(len(choice.token_ids) for choice in choices)
    prompt_tokens = int(final.stats.prompt_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class LogprobStream:
    """One sequence's log-prob records as a stream sends them: each once, in order, every chunk
    with its own tokens' (as OpenAI streams them), completions' text offsets running on."""

    def __init__(self, writer: ResponseWriter) -> None:
        self._writer = writer
        self._num_sent = 0
        self._text_offset = 0

    def add(self, records: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
        """A delta's records (None when it has none: no logprobs asked)."""
        if not records:
            return None
        return self._send(records)

    def finish(
        self, records: Sequence[common_pb2.TokenLogprob], parsed: CompletionRequest
    ) -> dict[str, Any] | None:
        """records: the final beam's, all of them; the ones no delta carried go with the last chunk."""
        if parsed.num_logprobs is None:
            return None
        return self._send([] if parsed.drops_generated else list(records)[self._num_sent :])

    def _send(self, records: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
        body = self._writer.logprobs_of(records, self._text_offset)
        self._num_sent += len(records)
        if body is not None:
            self._text_offset += sum(len(token) for token in body.get("tokens", []))
        return body
