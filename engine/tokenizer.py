"""Text to token ids and back.

`HFTokenizer` wraps a `tokenizer.json` through the `tokenizers` library; `ByteTokenizer` is the
fallback for a model directory without one (and for the embedded `tiny` model): ids 0..255 are
the bytes of the UTF-8 text, followed by a few special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as RawTokenizer

from engine.chat_template import ChatTemplate


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> ChatTemplate | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's spelling of one id (byte-level BPE: GPT-2's byte alphabet)."""
        ...


class ByteTokenizer:
    """Byte-level: token i < 256 is byte i. Specials come after the bytes and decode to nothing."""

    NUM_BYTES = 256
    BOS_TOKEN_ID = 256
    EOS_TOKEN_ID = 257
    PAD_TOKEN_ID = 258
    UNK_TOKEN_ID = 259
    VOCAB_SIZE = 260
    # ids 256.. in this order; spelled so that no ordinary text holds them (an exported tokenizer
    # matches added tokens in text, ByteTokenizer never does)
    SPECIAL_TOKENS = ("<|tiny_bos|>", "<|tiny_eos|>", "<|tiny_pad|>", "<|tiny_unk|>")

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS_TOKEN_ID

    @property
    def eos_token_id(self) -> int | None:
        return self.EOS_TOKEN_ID

    @property
    def chat_template(self) -> ChatTemplate | None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # No BOS is added either way: encode/decode round-trips, and callers that want one prepend it.
        return list(text.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str:
        if token_id < self.NUM_BYTES:
            return byte_alphabet()[token_id]
        return self.SPECIAL_TOKENS[token_id - self.NUM_BYTES]

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(token_id for token_id in token_ids if 0 <= token_id < self.NUM_BYTES)
        # A beam may stop in the middle of a multi-byte character.
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json`; special tokens are added on encode as the file's post-processor says.

    `add_bos_token` (a tokenizer built from GGUF metadata, which has no post-processor): bos is
    prepended unless the text already starts with it, so a chat template that writes `<bos>`
    itself encodes as `apply_chat_template` does (transformers would add a second one there).
    """

    def __init__(
        self,
        tokenizer: RawTokenizer,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: ChatTemplate | None = None,
        add_bos_token: bool = False,
    ) -> None:
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token needs a bos_token_id")
        self._tokenizer = tokenizer
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._chat_template = chat_template
        self._add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._chat_template

    @property
    def raw(self) -> RawTokenizer:
        """The `tokenizers` object (what `beamsplit model export` saves as tokenizer.json)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        token_ids = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self._add_bos_token and token_ids[:1] != [self._bos_token_id]:
            assert self._bos_token_id is not None
            token_ids.insert(0, self._bos_token_id)
        return token_ids

    def id_to_token(self, token_id: int) -> str:
        return str(self._tokenizer.id_to_token(token_id))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


def load_tokenizer(model_dir: str | Path, bos_token_id: int | None, eos_token_id: int | None) -> Tokenizer:
    """`tokenizer.json` when the directory has one, the byte-level fallback otherwise.

    The model config's bos/eos ids win; `tokenizer_config.json` fills them in when the config has none.
    """
    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return ByteTokenizer()
    raw = RawTokenizer.from_file(str(tokenizer_file))
    bos_text, eos_text, template = _tokenizer_config(model_dir / "tokenizer_config.json")
    if bos_token_id is None and bos_text is not None:
        bos_token_id = raw.token_to_id(bos_text)
    if eos_token_id is None and eos_text is not None:
        eos_token_id = raw.token_to_id(eos_text)
    bos_text = raw.id_to_token(bos_token_id) if bos_token_id is not None else bos_text
    eos_text = raw.id_to_token(eos_token_id) if eos_token_id is not None else eos_text
    chat_template = ChatTemplate(template, bos_text, eos_text) if template else None
    return HFTokenizer(raw, bos_token_id, eos_token_id, chat_template)


def _tokenizer_config(path: Path) -> tuple[str | None, str | None, str | None]:
    """(bos text, eos text, chat template) from `tokenizer_config.json`."""
    if not path.is_file():
        return None, None, None
    with open(path, encoding="utf-8") as file:
        raw = json.load(file)

    def text(value: object) -> str | None:
        # Either a plain string or an AddedToken dict {"content": ...}.
        if isinstance(value, dict):
            content = value.get("content")
            return content if isinstance(content, str) else None
        return value if isinstance(value, str) else None

    template = raw.get("chat_template")
    return (
        text(raw.get("bos_token")),
        text(raw.get("eos_token")),
        template if isinstance(template, str) else None,
    )
