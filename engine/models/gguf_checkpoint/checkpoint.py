"""A GGUF file: its Hugging Face config dict and ModelConfig, its tokenizer and chat template, its weights.

reader.py reads the format (metadata decoded in one pass, tensors memory-mapped), the `gguf`
package (llama.cpp's own Python library) names the types and de-quantizes the blocks to float32;
architectures.py and tensors.py map the metadata and tensors back to what the Hugging Face
checkpoint held, so a GGUF file and a directory go through the same `ModelConfig.from_dict`.
Refused with one line naming them: other architectures, `{architecture}.*` metadata keys no table
reads, tensor types `gguf` cannot de-quantize here, tokenizers other than byte-level BPE and
Gemma's SentencePiece BPE.
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
from gguf import GGMLQuantizationType, dequantize
from tokenizers import Tokenizer as RawTokenizer

from engine.chat_template import ChatTemplate
from engine.models.config import ModelConfig
from engine.models.gguf_checkpoint.architectures import ARCHITECTURES, Architecture
from engine.models.gguf_checkpoint.bpe_tokenizer import byte_level_bpe
from engine.models.gguf_checkpoint.metadata import GGUFError, Metadata
from engine.models.gguf_checkpoint.reader import GGUFFile
from engine.models.gguf_checkpoint.spm_tokenizer import sentencepiece_bpe
from engine.models.gguf_checkpoint.tensors import hf_tensors
from engine.models.q8_embedding import Q8Rows
from engine.tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip
TOKENIZER_BUILDERS: dict[str, Callable[[Metadata], RawTokenizer]] = {
    "gpt2": byte_level_bpe,
    "llama": sentencepiece_bpe,
}
# Tokenizers that prepend bos on encode (Gemma's does; SmolLM2's byte-level BPE does not, whatever
# the file's add_bos_token says: see bpe_tokenizer.py).
ADDS_BOS = {"llama"}


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    reader: GGUFFile
    hf_config: dict[str, Any]  # what the family's config.json would say
    architecture: Architecture

    @classmethod
    def open(cls, path: Path) -> GGUFCheckpoint:
        try:
            reader = GGUFFile.open(path)
        except Exception as error:  # truncated or not a GGUF file at all
            raise GGUFError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from error
        meta = Metadata(path, reader.fields)
        architecture = ARCHITECTURES.get(meta.architecture)
        if architecture is None:
            raise meta.error(
                f"architecture {meta.architecture!r} is not supported (supported: {tuple(ARCHITECTURES)})"
            )
        try:
            hf_config = architecture.config(meta, frozenset(tensor.name for tensor in reader.tensors))
        except (TypeError, ValueError) as error:
            if isinstance(error, GGUFError):
                raise
            raise meta.error(str(error)) from error
        unread = meta.unread_architecture_keys()
        if unread:
            raise meta.error(
                f"metadata {unread} is not supported (not read by the {architecture.name} table)"
            )
        return cls(path, reader, hf_config, architecture)

    @property
    def config(self) -> ModelConfig:
        """The family layer's parse of `hf_config`; what it refuses is named with this file."""
        try:
            return ModelConfig.from_dict(self.hf_config)
        except (TypeError, ValueError) as error:
            raise GGUFError(f"{self.path}: {error}") from error

    def tokenizer(self) -> HFTokenizer:
        meta = Metadata(self.path, self.reader.fields)
        kind = meta.get("tokenizer.ggml.model")
        if kind not in TOKENIZER_BUILDERS:
            raise meta.error(
                f"tokenizer.ggml.model {kind!r} is not supported (supported: {tuple(TOKENIZER_BUILDERS)})"
            )
        raw = TOKENIZER_BUILDERS[kind](meta)
        tokens: list[str] = meta.get("tokenizer.ggml.tokens")
        bos, eos = self.hf_config["bos_token_id"], self.hf_config["eos_token_id"]
        source = meta.get("tokenizer.chat_template")
        chat_template = (
            ChatTemplate(
                source,
                bos_token=tokens[bos] if bos is not None else None,
                eos_token=tokens[eos] if eos is not None else None,
            )
            if source
            else None
        )
        adds_bos = (
            kind in ADDS_BOS and bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
        )
        return HFTokenizer(raw, bos, eos, chat_template, add_bos_token=adds_bos)

    def state_dict(
        self, dtype: torch.dtype, progress: Callable[[str], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every tensor de-quantized to float32 by `gguf`, converted back, then cast to `dtype`."""
        refused = sorted(
            {tensor.tensor_type.name for tensor in self.reader.tensors}
            - {kind.name for kind in SUPPORTED_TENSOR_TYPES}
        )
        if refused:
            raise GGUFError(f"{self.path}: tensor types {refused} are not supported (quantization)")
        meta = Metadata(self.path, self.reader.fields)
        state: dict[str, torch.Tensor] = {}
        started, num_tensors = time.monotonic(), len(self.reader.tensors)
        for index, tensor in enumerate(self.reader.tensors, start=1):
            # np.asarray drops the memmap subclass, whose per-row slicing overhead doubled de-quantization.
            floats = dequantize(np.asarray(tensor.data), tensor.tensor_type)
            values = torch.from_numpy(np.require(floats, requirements=("C", "W")))
            for name, converted in hf_tensors(meta, self.architecture, self.hf_config, tensor.name, values):
                state[name] = converted.to(dtype)
            if progress is not None and (index % 64 == 0 or index == num_tensors):
                progress(f"de-quantized {index}/{num_tensors} tensors ({time.monotonic() - started:.1f} s)")
        return state

    def embedding_q8_rows(self) -> Q8Rows | None:
        """The token embedding's rows as the file stores them where that is Q8_0, else None (see
        engine/models/q8_embedding.py: the engine may keep them instead of a dense copy)."""
        for tensor in self.reader.tensors:
            if tensor.name == "token_embd.weight" and tensor.tensor_type == GGMLQuantizationType.Q8_0:
                return Q8Rows.from_blocks(torch.from_numpy(np.array(tensor.data, dtype=np.uint8)))
        return None
