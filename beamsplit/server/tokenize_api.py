"""vLLM's `/tokenize` and `/detokenize` bodies over the served model's tokenizer.

Client tools count tokens with them (and check a prompt's length before sending it), so the ids
are the ones the completions route feeds the model: `tokenizer.encode(prompt)` with the special
tokens the tokenizer's post-processor adds, unless `add_special_tokens` is false. The shapes
follow vLLM's `TokenizeCompletionRequest`, `TokenizeChatRequest`, `TokenizeResponse`,
`DetokenizeRequest` and `DetokenizeResponse`; a field vLLM has and this server does not
implement (`chat_template`, `tools`, ...) is refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from beamsplit.server.openai_wire import OpenAIRequestError, bool_field, render_chat, request_fields
from engine.tokenizer import Tokenizer

COMPLETION_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "return_token_strs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(body: object, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> dict[str, Any]:
    """`{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` is null unless asked for."""
    is_chat = isinstance(body, Mapping) and "messages" in body
    fields = request_fields(body, CHAT_FIELDS if is_chat else COMPLETION_FIELDS, model_name)
    if is_chat:
        if bool_field(fields, "continue_final_message", False):
            raise OpenAIRequestError("continue_final_message", "continue_final_message is not supported")
        text = render_chat(
            fields["messages"], tokenizer, model_name, bool_field(fields, "add_generation_prompt", True)
        )
        add_special_tokens = bool_field(fields, "add_special_tokens", False)  # vLLM's chat default
    else:
        prompt = fields.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIRequestError("prompt", "prompt must be a string (or send messages)")
        text = prompt
        add_special_tokens = bool_field(fields, "add_special_tokens", True)
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    token_strs = (
        [tokenizer.id_to_token(token_id) for token_id in token_ids]
        if bool_field(fields, "return_token_strs", False)
        else None
    )
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }


def detokenize(body: object, tokenizer: Tokenizer, model_name: str) -> dict[str, Any]:
    """`{"prompt": text}`: special tokens are dropped, as in the completions' text."""
    fields = request_fields(body, DETOKENIZE_FIELDS, model_name)
    token_ids = fields.get("tokens")
    if not isinstance(token_ids, list) or not all(
        isinstance(token_id, int) and not isinstance(token_id, bool) for token_id in token_ids
    ):
        raise OpenAIRequestError("tokens", "tokens must be a list of token ids")
    for token_id in token_ids:
        if not 0 <= token_id < tokenizer.vocab_size:
            raise OpenAIRequestError(
                "tokens", f"tokens: id {token_id} is outside the vocabulary [0, {tokenizer.vocab_size})"
            )
    return {"prompt": tokenizer.decode(token_ids)}
