"""OpenAI JSON -> the client API's `GenerateRequest`, so the HTTP front and gRPC share one validation.

This module only checks what JSON adds (types, unknown fields, OpenAI-only combinations) and maps
names; every range check (beam width, max tokens, token ids, temperature with beams, prompt
length) is left to `request_validation`, whose messages name proto fields. `openai_param` maps
those names back to the OpenAI field the client sent, for the error body's `param`.

Field mapping (docs/http.md has the table for users):
    prompt (text | token ids)      -> text | token_ids
    messages (chat)                -> text rendered by the tokenizer's chat template
    max_tokens                     -> sampling.max_new_tokens
    use_beam_search / best_of / n  -> sampling.beam_width (best_of, else n); n beams returned
    length_penalty, early_stopping -> the same sampling fields
    stop_token_ids [id]            -> sampling.eos_token_id (replaces the model's eos)
    temperature (default 1, 0 with beams), top_p, top_k, seed, ignore_eos -> the same fields
    stop (strings)                 -> sampling.stop_strings (the engine ends each sequence or beam
                                      there); the front also cuts the text before the first one
    logprobs k (completions), logprobs + top_logprobs k (chat) -> sampling.logprobs
    echo with logprobs k           -> sampling.prompt_logprobs (every prompt position scored)
    max_tokens 0                   -> sampling.max_new_tokens 1, its token dropped by the front
    prompt: several prompts        -> one GenerateRequest each (`requests`), choices in prompt order
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from beamsplit.server.request_validation import EARLY_STOPPING_TO_PROTO
from beamsplit.v1 import common_pb2, coordinator_pb2
from engine.chat_template import ChatTemplateError
from engine.config import SamplingParams
from engine.tokenizer import Tokenizer

OPENAI_DEFAULT_TEMPERATURE = 1.0  # what OpenAI samples with when the field is absent
MAX_STOP_STRINGS = SamplingParams.MAX_STOP_STRINGS
MAX_LOGPROBS = 20  # OpenAI's bound on logprobs / top_logprobs
MAX_PROMPTS = 64  # prompts in one completions request (lm-eval batches send several)

_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "n", "best_of", "use_beam_search", "length_penalty", "early_stopping",
        "stop", "stop_token_ids", "temperature", "top_p", "top_k", "seed", "logprobs", "stream",
        "stream_options", "ignore_eos", "user", "frequency_penalty", "presence_penalty", "logit_bias",
    }
)  # fmt: skip
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}

# Proto field named at the start of a validation message -> the OpenAI field it came from.
_PROTO_TO_OPENAI = {
    "sampling.max_new_tokens": "max_tokens",
    "sampling.length_penalty": "length_penalty",
    "sampling.early_stopping": "early_stopping",
    "sampling.eos_token_id": "stop_token_ids",
    "sampling.temperature": "temperature",
    "sampling.top_k": "top_k",
    "sampling.top_p": "top_p",
    "sampling.seed": "seed",
    "sampling.stop_strings": "stop",
}


class OpenAIRequestError(ValueError):
    """A client mistake found before the request reaches the backend; `param` is the JSON field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class CompletionRequest:
    """The proto the backend takes, plus what only the HTTP front acts on."""

    request: coordinator_pb2.GenerateRequest
    num_choices: int  # n: beams returned (best first), or 1
    is_beam_search: bool
    stop: tuple[str, ...]  # the engine ends sequences there; the front cuts each choice's text before it
    is_stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    prompt_param: str  # "prompt" or "messages", for errors about the prompt
    beam_width_param: str  # "best_of" or "n"
    # Scoring: one request per prompt (`request` is the first); the prompt echoed before the
    # generated text; per-token log-probs with `num_logprobs` alternatives (None: none asked);
    # max_tokens 0, run as 1 token that the front drops.
    requests: tuple[coordinator_pb2.GenerateRequest, ...] = ()
    echo: bool = False
    num_logprobs: int | None = None
    drops_generated: bool = False

    @property
    def all_requests(self) -> tuple[coordinator_pb2.GenerateRequest, ...]:
        return self.requests or (self.request,)


def parse_completion_request(body: object, model_name: str) -> CompletionRequest:
    fields = _fields(body, COMPLETION_FIELDS, model_name)
    echo = bool_field(fields, "echo", False)
    if _str(fields, "suffix", "") != "":
        raise OpenAIRequestError("suffix", "suffix (insertion) is not supported")
    num_logprobs = _num_logprobs(fields, "logprobs")
    prompts = _prompts(fields.get("prompt"))
    parsed = _with_sampling(_prompt_request(prompts[0]), fields, "prompt", max_tokens_name="max_tokens")
    # Streamed log-probs are the generated tokens', chunk by chunk; echo's prompt scores are not
    # streamed (OpenAI's current completions model refuses echo with logprobs altogether).
    if parsed.is_stream and (echo or len(prompts) > 1):
        param = "echo" if echo else "prompt"
        raise OpenAIRequestError(param, f"{param}: not supported with stream (ask without streaming)")
    sampling = parsed.request.sampling
    if num_logprobs is not None:
        sampling.logprobs = num_logprobs
        if echo:
            sampling.prompt_logprobs = num_logprobs
    requests = []
    for prompt in prompts:
        request = _prompt_request(prompt)
        request.sampling.CopyFrom(sampling)
        requests.append(request)
    return replace(
        parsed,
        request=requests[0],
        requests=tuple(requests),
        echo=echo,
        num_logprobs=num_logprobs,
        drops_generated=parsed.drops_generated,
    )


def _prompts(prompt: object) -> list[str | list[int]]:
    """A string, a list of token ids, or a non-empty list of either (a batch)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        items: list[object] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        items = list(prompt)
    else:
        raise OpenAIRequestError(
            "prompt", "prompt must be a string, a list of token ids, or a list of either"
        )
    if len(items) > MAX_PROMPTS:
        raise OpenAIRequestError(
            "prompt", f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}"
        )
    prompts: list[str | list[int]] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and all(_is_int(token) for token in item):
            if not all(-(2**63) <= token < 2**63 for token in item):
                raise OpenAIRequestError("prompt", f"prompt[{index}]: a token id is out of range")
            prompts.append(list(item))
        else:
            raise OpenAIRequestError("prompt", f"prompt[{index}] must be a string or a list of token ids")
    return prompts


def _prompt_request(prompt: str | list[int]) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.CopyFrom(common_pb2.TokenIds(token_ids=prompt))
    return request


def _num_logprobs(fields: dict[str, Any], name: str) -> int | None:
    """logprobs k in [0, MAX_LOGPROBS] (completions); None when absent or false."""
    value = fields.get(name)
    if value is None or value is False:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIRequestError(name, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    return int(value)


def parse_chat_request(body: object, model_name: str, tokenizer: Tokenizer) -> CompletionRequest:
    fields = _fields(body, CHAT_FIELDS, model_name)
    wants_logprobs = bool_field(fields, "logprobs", False)
    num_top = _int(fields, "top_logprobs", None, bits=32)
    if num_top is not None and not 0 <= num_top <= MAX_LOGPROBS:
        raise OpenAIRequestError(
            "top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {num_top}"
        )
    if num_top is not None and not wants_logprobs:
        raise OpenAIRequestError("top_logprobs", "top_logprobs needs logprobs: true")
    template = tokenizer.chat_template
    if template is None:
        raise OpenAIRequestError(
            "messages",
            f"model {model_name!r} has no chat template: use /v1/completions with a prompt instead",
        )
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages", "messages must be a non-empty list of {role, content} objects")
    rendered = [_chat_message(message, index) for index, message in enumerate(messages)]
    try:
        text = template.render(rendered)
    except ChatTemplateError as error:
        raise OpenAIRequestError("messages", f"messages: {error}") from error
    request = coordinator_pb2.GenerateRequest(text=text)
    max_tokens_name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    parsed = _with_sampling(request, fields, "messages", max_tokens_name=max_tokens_name)
    if not wants_logprobs:
        return parsed
    parsed.request.sampling.logprobs = num_top or 0
    return replace(parsed, num_logprobs=num_top or 0)


def openai_param(message: str, parsed: CompletionRequest) -> str | None:
    """The OpenAI field a `request_validation` message is about (None: not one field)."""
    if message.startswith("prompt"):
        return parsed.prompt_param
    if message.startswith("sampling.beam_width"):
        return parsed.beam_width_param
    for proto_name, param in _PROTO_TO_OPENAI.items():
        if message.startswith(proto_name):
            return param
    return None


def request_fields(body: object, known: frozenset[str], model_name: str) -> dict[str, Any]:
    """A JSON body's non-null fields; a field outside `known`, or another model, is refused."""
    if not isinstance(body, Mapping):
        raise OpenAIRequestError(None, "the request body must be a JSON object")
    fields = {str(name): value for name, value in body.items() if value is not None}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise OpenAIRequestError(unknown[0], f"{unknown[0]} is not a field this server implements")
    model = fields.get("model")
    if model is not None and model != model_name:
        raise OpenAIRequestError(
            "model", f"model {model!r} is not served here; this server serves {model_name!r}"
        )
    return fields


def _fields(body: object, known: frozenset[str], model_name: str) -> dict[str, Any]:
    fields = request_fields(body, known, model_name)
    for name in ("frequency_penalty", "presence_penalty"):
        if _float(fields, name, 0.0) != 0.0:
            raise OpenAIRequestError(name, f"{name} is not supported (only 0)")
    if fields.get("logit_bias"):
        raise OpenAIRequestError("logit_bias", "logit_bias is not supported")
    _str(fields, "user", "")
    return fields


def _with_sampling(
    request: coordinator_pb2.GenerateRequest, fields: dict[str, Any], prompt_param: str, max_tokens_name: str
) -> CompletionRequest:
    n = _int(fields, "n", 1, bits=32)
    best_of = _int(fields, "best_of", None, bits=32)
    temperature = _float(fields, "temperature", None)
    is_beam_search = bool_field(fields, "use_beam_search", False) or (
        best_of is not None and best_of > 1 and temperature == 0.0
    )
    if n < 1:
        raise OpenAIRequestError("n", f"n must be >= 1, got {n}")
    if best_of is not None and best_of < 1:
        raise OpenAIRequestError("best_of", f"best_of must be >= 1, got {best_of}")
    options = common_pb2.SamplingOptions()
    if is_beam_search:
        options.beam_width = best_of if best_of is not None else n
        if best_of is not None and n > best_of:
            raise OpenAIRequestError("n", f"n must be <= best_of, got n={n}, best_of={best_of}")
        options.temperature = 0.0 if temperature is None else temperature
    else:
        if n > 1 or (best_of is not None and best_of > 1):
            param = "n" if n > 1 else "best_of"
            raise OpenAIRequestError(
                param,
                f"{param} > 1 needs beam search (use_beam_search: true, or best_of > 1 with temperature 0); "
                "independent samples are not supported",
            )
        options.temperature = OPENAI_DEFAULT_TEMPERATURE if temperature is None else temperature
    max_tokens = _int(fields, max_tokens_name, None, bits=32)
    if max_tokens is not None:
        # 0 (score the prompt, generate nothing): the engine decides one token, which is dropped.
        options.max_new_tokens = 1 if max_tokens == 0 else max_tokens
    length_penalty = _float(fields, "length_penalty", None)
    if length_penalty is not None:
        options.length_penalty = length_penalty
    options.early_stopping = _early_stopping(fields)
    top_p = _float(fields, "top_p", None)
    if top_p is not None:
        options.top_p = top_p
    options.top_k = _int(fields, "top_k", 0, bits=32)
    seed = _int(fields, "seed", None)
    if seed is not None:
        options.seed = seed
    options.ignore_eos = bool_field(fields, "ignore_eos", False)
    stop_token_ids = fields.get("stop_token_ids", [])
    if not isinstance(stop_token_ids, list) or not all(
        _is_int(token) and -(2**63) <= token < 2**63 for token in stop_token_ids
    ):
        raise OpenAIRequestError("stop_token_ids", "stop_token_ids must be a list of token ids")
    if len(stop_token_ids) > 1:
        raise OpenAIRequestError(
            "stop_token_ids", "stop_token_ids: the engine stops on one token id; give at most one"
        )
    if stop_token_ids:
        options.eos_token_id = stop_token_ids[0]
    stop = _stop_strings(fields)
    options.stop_strings.extend(stop)
    stream_options = fields.get("stream_options", {})
    if not isinstance(stream_options, Mapping):
        raise OpenAIRequestError("stream_options", "stream_options must be an object")
    include_usage = bool_field(dict(stream_options), "include_usage", False)
    request.sampling.CopyFrom(options)
    return CompletionRequest(
        request=request,
        num_choices=n,
        is_beam_search=is_beam_search,
        stop=stop,
        is_stream=bool_field(fields, "stream", False),
        include_usage=include_usage,
        prompt_param=prompt_param,
        beam_width_param="best_of" if best_of is not None else "n",
        drops_generated=max_tokens == 0,
    )


def _chat_message(message: object, index: int) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise OpenAIRequestError("messages", f"messages[{index}] must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise OpenAIRequestError("messages", f"messages[{index}].role must be a string")
    if isinstance(content, list):  # content parts: only text can be rendered
        texts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise OpenAIRequestError(
                    "messages", f"messages[{index}].content: only text parts are supported"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise OpenAIRequestError("messages", f"messages[{index}].content must be a string or text parts")
    return {"role": role, "content": content}


def _stop_strings(fields: dict[str, Any]) -> tuple[str, ...]:
    stop = fields.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(item, str) and item for item in stop):
        raise OpenAIRequestError("stop", "stop must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise OpenAIRequestError("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    return tuple(stop)


def _early_stopping(fields: dict[str, Any]) -> Any:
    value = fields.get("early_stopping", False)
    if value not in (True, False, "never") or _is_int(value):
        raise OpenAIRequestError(
            "early_stopping", f'early_stopping must be true, false or "never", got {value!r}'
        )
    return EARLY_STOPPING_TO_PROTO[value]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(fields: dict[str, Any], name: str, default: Any, bits: int = 64) -> Any:
    """An integer that fits the proto field (`bits` wide, signed), so range errors name the field."""
    value = fields.get(name, default)
    if value is not default and not _is_int(value):
        raise OpenAIRequestError(name, f"{name} must be an integer, got {value!r}")
    if value is not None and not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise OpenAIRequestError(name, f"{name} is out of range, got {value}")
    return value


def _float(fields: dict[str, Any], name: str, default: Any) -> Any:
    value = fields.get(name, default)
    if value is not default and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise OpenAIRequestError(name, f"{name} must be a number, got {value!r}")
    try:
        return None if value is None else float(value)
    except OverflowError:
        raise OpenAIRequestError(name, f"{name} is out of range") from None


def bool_field(fields: dict[str, Any], name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if not isinstance(value, bool):
        raise OpenAIRequestError(name, f"{name} must be true or false, got {value!r}")
    return value


def _str(fields: dict[str, Any], name: str, default: str) -> str:
    value = fields.get(name, default)
    if not isinstance(value, str):
        raise OpenAIRequestError(name, f"{name} must be a string, got {value!r}")
    return value


def render_chat(messages: object, tokenizer: Tokenizer, model_name: str, add_generation_prompt: bool) -> str:
    """`messages` through the model's chat template, as chat completions render them (for /tokenize)."""
    template = tokenizer.chat_template
    if template is None:
        raise OpenAIRequestError("messages", f"model {model_name!r} has no chat template")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages", "messages must be a non-empty list of {role, content} objects")
    rendered = [_chat_message(message, index) for index, message in enumerate(messages)]
    try:
        return template.render(rendered, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as error:
        raise OpenAIRequestError("messages", f"messages: {error}") from error
