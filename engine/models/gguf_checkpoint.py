"""A Llama-architecture GGUF file: its config, its tokenizer and chat template, and its weights.

The `gguf` package (llama.cpp's own Python library) reads the format and de-quantizes the blocks
to float32; this module only maps names and shapes. Refused with one line naming them: other
architectures, tensor types `gguf` cannot de-quantize here, tokenizers other than byte-level BPE,
rope variants the engine does not implement.

Two conversions undo what llama.cpp's converter did to a Hugging Face checkpoint:
- tensor names: `blk.{i}.attn_q.weight` -> `layers.{i}.self_attn.q_proj.weight`, and so on;
- q and k rows: llama.cpp interleaves each head's two rotary halves (row pairs (j, j + D/2) become
  (2j, 2j + 1)) for its own rope kernel; the engine rotates halves, so the rows are put back:

      per head, GGUF row 2j   -> row j          j in [0, D/2)
                GGUF row 2j+1 -> row j + D/2
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from engine.chat_template import ChatTemplate
from engine.models.config import ModelConfig
from engine.tokenizer import HFTokenizer, byte_alphabet

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip
# llama.cpp's pre-tokenizer names -> how text is split before byte-level BPE. "smollm" puts every
# digit on its own, as SmolLM's own tokenizer.json does (Digits(individual_digits=True)).
BYTE_LEVEL_PRE_TOKENIZERS = {"gpt2": False, "smollm": True}
CONTROL_TOKEN_TYPE = 3  # llama.cpp's token type for specials such as <|im_start|>
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


class GGUFError(ValueError):
    """A GGUF file this engine cannot run; the message is one line naming the file and the reason."""


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    reader: GGUFReader
    config: ModelConfig

    @classmethod
    def open(cls, path: Path) -> GGUFCheckpoint:
        try:
            reader = GGUFReader(path)
        except Exception as error:  # truncated or not a GGUF file at all
            raise GGUFError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from error
        return cls(path, reader, _model_config(path, reader))

    def tokenizer(self) -> HFTokenizer:
        return _tokenizer(self.path, self.reader, self.config)

    def state_dict(
        self, dtype: torch.dtype, progress: Callable[[str], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every tensor de-quantized to float32 by `gguf`, then cast to `dtype`, under engine names."""
        refused = sorted(
            {tensor.tensor_type.name for tensor in self.reader.tensors}
            - {kind.name for kind in SUPPORTED_TENSOR_TYPES}
        )
        if refused:
            raise GGUFError(f"{self.path}: tensor types {refused} are not supported (quantization)")
        state: dict[str, torch.Tensor] = {}
        started, num_tensors = time.monotonic(), len(self.reader.tensors)
        for index, tensor in enumerate(self.reader.tensors, start=1):
            name = _engine_name(self.path, tensor.name)
            # np.asarray drops the memmap subclass, whose per-row slicing overhead doubled de-quantization.
            floats = dequantize(np.asarray(tensor.data), tensor.tensor_type)
            values = torch.from_numpy(np.require(floats, requirements=("C", "W")))
            if name.endswith("q_proj.weight"):
                values = _undo_rotary_interleave(values, self.config.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                values = _undo_rotary_interleave(values, self.config.num_key_value_heads)
            state[name] = values.to(dtype)
            if progress is not None and (index % 64 == 0 or index == num_tensors):
                progress(f"de-quantized {index}/{num_tensors} tensors ({time.monotonic() - started:.1f} s)")
        return state


def _undo_rotary_interleave(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads * D, E] in llama.cpp's row order -> Hugging Face's (see the module docstring)."""
    rows, width = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, width).transpose(1, 2).reshape(rows, width)


def _engine_name(path: Path, gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFError(f"{path}: tensor {gguf_name!r} is not part of a Llama model this engine runs")


def _model_config(path: Path, reader: GGUFReader) -> ModelConfig:
    architecture = _value(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {architecture!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = _value(reader, f"{architecture}.{name}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata {architecture}.{name} is missing")
        return value

    scaling = _value(reader, f"{architecture}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in {tensor.name for tensor in reader.tensors}:
        raise GGUFError(f"{path}: rope scaling {scaling!r} / rope_freqs is not supported")
    num_heads, hidden_size = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{path}: partial rotary (rope.dimension_count != head dim) is not supported")
    tensor_names = {tensor.name for tensor in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = _value(reader, f"{architecture}.vocab_size", len(tokens.data) if tokens else None)
    try:
        return ModelConfig(
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length")),
            # llama.cpp writes no output.weight when the head is the embedding
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_value(reader, "tokenizer.ggml.eos_token_id"),
        )
    except (TypeError, ValueError) as error:
        raise GGUFError(f"{path}: {error}") from error


def _tokenizer(path: Path, reader: GGUFReader, config: ModelConfig) -> HFTokenizer:
    """Byte-level BPE from the vocabulary and merges in the metadata.

    No BOS is prepended even where the file sets `add_bos_token`: llama.cpp's converter sets it for
    SmolLM2 although the model's own tokenizer adds none, and transformers adds none either.
    """
    kind = _value(reader, "tokenizer.ggml.model")
    pre = _value(reader, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in BYTE_LEVEL_PRE_TOKENIZERS:
        raise GGUFError(
            f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
            f"(supported: 'gpt2' with {tuple(BYTE_LEVEL_PRE_TOKENIZERS)})"
        )
    tokens: list[str] = _value(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _value(reader, "tokenizer.ggml.merges")
    token_types: list[int] = _value(reader, "tokenizer.ggml.token_type", [])
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
    source = _value(reader, "tokenizer.chat_template")
    bos, eos = config.bos_token_id, config.eos_token_id
    chat_template = (
        ChatTemplate(
            source,
            bos_token=tokens[bos] if bos is not None else None,
            eos_token=tokens[eos] if eos is not None else None,
        )
        if source
        else None
    )
    return HFTokenizer(raw, bos, eos, chat_template)


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _value(reader: GGUFReader, name: str, default: Any = None) -> Any:
    field: ReaderField | None = reader.fields.get(name)
    if field is None:
        return default
    if field.types[0] is GGUFValueType.ARRAY:
        if field.types[-1] is GGUFValueType.STRING:
            return [bytes(field.parts[index]).decode("utf-8") for index in field.data]
        return [field.parts[index].tolist()[0] for index in field.data]
    if field.types[0] is GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]
