"""Byte-level BPE (`tokenizer.ggml.model = gpt2`, SmolLM2's kind) from a GGUF file's metadata."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from engine.models.gguf_checkpoint.metadata import Metadata
from engine.tokenizer import byte_alphabet

# llama.cpp's pre-tokenizer names -> how text is split before byte-level BPE. "smollm" puts every
# digit on its own, as SmolLM's own tokenizer.json does (Digits(individual_digits=True)).
BYTE_LEVEL_PRE_TOKENIZERS = {"gpt2": False, "smollm": True}
CONTROL_TOKEN_TYPE = 3  # llama.cpp's token type for specials such as <|im_start|>


def byte_level_bpe(meta: Metadata) -> RawTokenizer:
    """The vocabulary and merges in the metadata; CONTROL tokens kept whole as special tokens.

    No BOS is prepended even where the file sets `add_bos_token`: llama.cpp's converter sets it for
    SmolLM2 although the model's own tokenizer adds none, and transformers adds none either.
    """
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in BYTE_LEVEL_PRE_TOKENIZERS:
        raise meta.error(
            f"tokenizer.ggml.pre {pre!r} is not supported for gpt2 (supported: {tuple(BYTE_LEVEL_PRE_TOKENIZERS)})"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges: list[str] = meta.get("tokenizer.ggml.merges", [])
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[byte] for byte in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    raw = RawTokenizer(
        models.BPE(vocab=vocab, merges=[_merge_pair(merge) for merge in merges], fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if BYTE_LEVEL_PRE_TOKENIZERS[pre]:
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        raw.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        raw.pre_tokenizer = byte_level
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == CONTROL_TOKEN_TYPE
        ]
    )
    return raw


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right
