"""SentencePiece-style BPE (`tokenizer.ggml.model = llama`, Gemma's kind) from a GGUF file's metadata.

Gemma's tokenizer is BPE over the text with every space written "▁", with byte fallback
(`<0x41>` tokens) for what the vocabulary cannot spell and no prefix space. The file carries the
vocabulary, scores and token types but no merges, so they are rebuilt from the vocabulary: every
cut of a token into two vocabulary tokens is a merge producing it. Their order is the tokens'
order in the file (Gemma's scores do not follow the merge order: most are the same -1000), and
within one token the cut with the longer left part first; this is the order transformers' GGUF
loader builds, so both encode alike.

Two of the file's spellings are Gemma's own: tokens made only of spaces are stored with real
spaces but looked up as "▁" runs (the normaliser has turned every space into "▁" before BPE sees
the text), so they are respelled.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as RawTokenizer

from engine.models.gguf_checkpoint.metadata import Metadata

SPACE = "▁"  # U+2581, SentencePiece's visible space
CONTROL_TOKEN_TYPE = 3  # <bos>, <start_of_turn>, <unusedN>: special, kept whole, dropped on decode
USER_DEFINED_TOKEN_TYPE = 4  # "\n\n", "<b>" ...: always matched whole in text, not special
SUPPORTED_ARCHITECTURES = ("gemma3",)


def sentencepiece_bpe(meta: Metadata) -> RawTokenizer:
    if meta.architecture not in SUPPORTED_ARCHITECTURES:
        raise meta.error(
            f"tokenizer.ggml.model 'llama' (SentencePiece) is supported for {SUPPORTED_ARCHITECTURES} "
            f"only, not {meta.architecture!r}"
        )
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise meta.error("tokenizer.ggml.add_space_prefix=True is not supported (Gemma adds no prefix space)")
    tokens = [_respell(token) for token in meta.get("tokenizer.ggml.tokens")]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    unknown_id = meta.get("tokenizer.ggml.unknown_token_id")
    # A token spelled twice keeps its last id, as a dict built in file order does in transformers.
    vocab = {token: index for index, token in enumerate(tokens)}
    raw = RawTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges(vocab),
            unk_token=tokens[unknown_id] if unknown_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    raw.normalizer = normalizers.Replace(" ", SPACE)
    raw.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    typed = list(zip(tokens, token_types, strict=False))
    raw.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in typed
            if kind == CONTROL_TOKEN_TYPE
        ]
    )
    raw.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in typed
            if kind == USER_DEFINED_TOKEN_TYPE
        ]
    )
    return raw


def _respell(token: str) -> str:
    return SPACE * len(token) if token and not token.strip(" ") else token


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """(left, right) pairs best first: by the merged token's id, then the longer left part first."""
    merges: list[tuple[str, str]] = []
    for token in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
