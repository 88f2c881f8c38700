"""A model's chat template: the Jinja text that turns a list of messages into one prompt string.

Rendered the way Hugging Face tokenizers render it (a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, `bos_token`/`eos_token` and `raise_exception` in scope), so the
prompt's token ids equal transformers' `apply_chat_template` for the same template and messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NoReturn

from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (its `raise_exception`) or could not be rendered."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        self.source = source
        self._template = environment.from_string(source)
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        for index, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise ChatTemplateError(f"messages[{index}] needs a string 'role' and a string 'content'")
        try:
            return str(
                self._template.render(
                    messages=[dict(message) for message in messages],
                    add_generation_prompt=add_generation_prompt,
                    **self._special,
                )
            )
        except ChatTemplateError:
            raise
        except Exception as error:  # a template bug must not look like a server crash
            raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {error}") from error
