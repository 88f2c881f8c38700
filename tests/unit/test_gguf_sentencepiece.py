"""Gemma's SentencePiece tokenizer and chat template from a tiny GGUF file written here.

The vocabulary is Gemma's in small: control tokens, user-defined newline runs, byte fallback
tokens, space-only tokens stored with real spaces, and merges implied by the pieces in file order.
The engine's tokenizer must encode and decode as transformers' GGUF tokenizer for the same file,
and a Gemma-style chat template that writes `<bos>` itself must give `apply_chat_template`'s ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter

from engine.models.gguf_checkpoint import GGUFCheckpoint, GGUFError

transformers = pytest.importorskip("transformers")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
BYTES = [f"<0x{byte:02X}>" for byte in range(256)]
PIECES = [
    "\n", "\n\n", "  ", "   ", "▁", "e", "r", "s", "u", "m", "o", "d", "l", "H", "i", "a", "t", "h", "y",
    "us", "er", "user", "mo", "del", "model", "▁H", "Hi", "▁Hi", "he", "the", "▁the", "sy", "st", "em", "system",
]  # fmt: skip
TOKENS = SPECIALS + ["\n", "\n\n"] + BYTES + PIECES[2:]
TYPES = (
    [3] * len(SPECIALS) + [4, 4] + [6] * 256 + [1] * (len(PIECES) - 2)
)  # control, user-defined, byte, normal
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEXTS = ("Hi the system", "user  model\n\nHi", "the   end", "héllo ✓", "", " Hi ", "<start_of_turn>user\nHi")


def write_gemma_tokenizer_gguf(path: Path, add_space_prefix: bool = False) -> Path:
    writer = GGUFWriter(str(path), "gemma3")
    for name, value in {
        "context_length": 512,
        "embedding_length": 32,
        "block_count": 6,
        "feed_forward_length": 64,
    }.items():
        writer.add_uint32(f"gemma3.{name}", value)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([-1000.0] * len(TOKENS))  # Gemma's scores say nothing of the merge order
    writer.add_token_types(TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(GEMMA_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    path = write_gemma_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "gemma.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return GGUFCheckpoint.open(path).tokenizer(), reference


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_as_transformers(files: tuple[Any, Any], text: str) -> None:
    tokenizer, reference = files
    expected = reference(text).input_ids
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected) == reference.decode(expected, skip_special_tokens=True)


def test_merges_spaces_and_fallback(files: tuple[Any, Any]) -> None:
    tokenizer, _ = files
    index = {token: position for position, token in enumerate(TOKENS)}
    # "▁the" is a piece; two spaces are the stored "  " token; "✓" has no piece: its 3 UTF-8 bytes
    assert tokenizer.encode(" the  ✓") == [
        2,
        index["▁the"],
        index["  "],
        index["<0xE2>"],
        index["<0x9C>"],
        index["<0x93>"],
    ]
    assert tokenizer.decode(tokenizer.encode(" the  ✓")) == " the  ✓"


@pytest.mark.parametrize("with_system", [False, True])
def test_chat_template_gives_apply_chat_template_ids(files: tuple[Any, Any], with_system: bool) -> None:
    tokenizer, reference = files
    messages = [{"role": "user", "content": "Hi the system"}, {"role": "assistant", "content": "Hi"}]
    if with_system:
        messages.insert(0, {"role": "system", "content": "the model"})
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert tokenizer.chat_template is not None
    text = tokenizer.chat_template.render(messages)
    assert text.startswith("<bos><start_of_turn>user\n")
    assert tokenizer.encode(text) == list(expected_ids)  # one <bos>, the template's


def test_space_prefix_is_refused(tmp_path: Path) -> None:
    path = write_gemma_tokenizer_gguf(tmp_path / "prefix.gguf", add_space_prefix=True)
    with pytest.raises(GGUFError, match="tokenizer.ggml.add_space_prefix=True is not supported"):
        GGUFCheckpoint.open(path).tokenizer()
