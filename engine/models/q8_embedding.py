"""A tied embedding kept in the checkpoint's Q8_0 form, so the packed LM head is its only dense copy.

A model whose LM head is tied to its embedding holds one [V, E] matrix used two ways: rows looked
up by token id, and the head's matrix product. The batch-invariant engine packs every linear
weight into oneDNN's blocked layout (engine/packed_linear.py), from which rows cannot be read, so
a tied head used to keep the dense matrix beside the packed one: 108 MiB more for SmolLM2-135M in
float32, 20% of its weights. A GGUF checkpoint usually stores that matrix as Q8_0 (llama.cpp keeps
token embeddings at 8 bits): blocks of 32 int8 codes with one float16 scale, de-quantized as
float32(scale) * float32(code), a product float32 holds exactly (11 + 8 significant bits). Kept in
that form the rows cost 34 bytes per 32 values (28 MiB for SmolLM2) and give the same bits as the
de-quantized matrix in any dtype: the same product, then the same cast. `untie_as_q8` checks that
on every row at load and leaves the model as it was otherwise; the head then owns the dense
matrix alone and packing drops it. A checkpoint directory de-quantized from such a file holds the
same values in float32: `Q8Rows.from_dense` finds the blocks again where every one rebuilds exactly.

Dimensions: V vocabulary, E hidden, B = E / 32 blocks a row, N token ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

Q8_BLOCK = 32  # values per Q8_0 block (ggml's QK8_0)
Q8_BLOCK_BYTES = 2 + Q8_BLOCK  # float16 scale, then 32 int8 codes


@dataclass(frozen=True)
class Q8Rows:
    """A [V, E] matrix in Q8_0 form: codes [V, E] int8, scales [V, B] float16."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor) -> Q8Rows:
        """blocks [V, B * 34] uint8, a GGUF Q8_0 tensor's rows as stored."""
        rows, width = blocks.shape
        if width % Q8_BLOCK_BYTES:
            raise ValueError(f"a Q8_0 row has a multiple of {Q8_BLOCK_BYTES} bytes, got {width}")
        grouped = blocks.reshape(rows, width // Q8_BLOCK_BYTES, Q8_BLOCK_BYTES)  # [V, B, 34]
        scales = grouped[:, :, :2].contiguous().view(torch.float16).reshape(rows, -1)  # [V, B]
        codes = grouped[:, :, 2:].contiguous().view(torch.int8).reshape(rows, -1)  # [V, E]
        return cls(codes, scales)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Q8Rows | None:
        """The Q8_0 form of a float32 [V, E] matrix whose every block of 32 is exactly a float16
        scale times int8 codes (a checkpoint de-quantized from a GGUF file is), else None.

        Q8_0 sets scale = amax / 127 and the largest code to +-127, so the de-quantized block's
        largest magnitude is scale * 127 exactly and amax / 127 gives the scale back; the codes
        then follow by division. Any block that does not rebuild to the same bits (a checkpoint
        trained or stored in float32, a -0.0) gives None: nothing is assumed, all is checked."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % Q8_BLOCK:
            return None
        rows = weight.shape[0]
        codes = torch.empty(weight.shape, dtype=torch.int8)  # [V, E]
        scales = torch.empty(rows, weight.shape[1] // Q8_BLOCK, dtype=torch.float16)  # [V, B]
        for first in range(0, rows, 4096):  # bounded scratch: 4096 rows at a time
            part = weight[first : first + 4096].detach().cpu()
            blocks = part.unflatten(-1, (-1, Q8_BLOCK))  # [n, B, 32]
            scale = blocks.abs().amax(dim=-1) / 127  # [n, B]
            half = scale.to(torch.float16)
            if not torch.equal(half.to(torch.float32), scale):
                return None
            divisor = torch.where(scale > 0, scale, 1.0)[..., None]
            code = (blocks / divisor).round().clamp(-127, 127).to(torch.int8)  # [n, B, 32]
            rebuilt = (code.to(torch.float32) * half.to(torch.float32)[..., None]).flatten(-2)
            if not same_bits(rebuilt, part):
                return None
            codes[first : first + 4096] = code.flatten(-2)
            scales[first : first + 4096] = half
        return cls(codes, scales)


class Q8Embedding(nn.Module):
    """Token ids -> rows of a Q8_0 matrix, de-quantized as gguf does, then cast to the model dtype.

    The codes and scales are integer buffers (int8, and the float16 scales' bits as int16), so
    `model.to(dtype)` leaves them alone; `_dtype` is an empty floating buffer that it does cast,
    so the output follows the model's dtype."""

    codes: torch.Tensor  # [V, E] int8
    scale_bits: torch.Tensor  # [V, B] int16, float16 bits
    _dtype: torch.Tensor  # [0] in the model dtype

    def __init__(self, rows: Q8Rows, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = rows.codes.shape
        self.register_buffer("codes", rows.codes)
        self.register_buffer("scale_bits", rows.scales.view(torch.int16))
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype))

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] (any shape) -> [..., E] in the model dtype."""
        codes = self.codes[input_ids].to(torch.float32)  # [N, E]
        scales = self.scale_bits[input_ids].view(torch.float16).to(torch.float32)  # [N, B]
        values = codes.unflatten(-1, (-1, Q8_BLOCK)) * scales.unsqueeze(-1)  # [N, B, 32], exact
        return values.flatten(-2).to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dense [V, E] matrix, de-quantized (for the rare reader: a state_dict, an export)."""
        return self(torch.arange(self.num_embeddings, device=self.codes.device))

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight  # the checkpoint's name and layout, not the buffers

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 rows"


def same_bits(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Equal bit patterns, not just values (torch.equal calls -0.0 and 0.0 equal)."""
    if first.dtype != second.dtype or first.shape != second.shape:
        return False
    as_integers = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[first.element_size()]
    return torch.equal(first.contiguous().view(as_integers), second.contiguous().view(as_integers))


def untie_as_q8(model: nn.Module, rows: Q8Rows | None) -> bool:
    """Where `model.lm_head` shares `model.embed_tokens`' weight and `rows` de-quantize to exactly
    that weight, replaces the embedding by a Q8Embedding (the head keeps the dense weight, alone);
    True when it did. Any mismatch (shape, a single bit) leaves the model as it was."""
    embedding, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if rows is None or not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear):
        return False
    if head.weight is not embedding.weight or rows.codes.shape != tuple(embedding.weight.shape):
        return False
    compact = Q8Embedding(rows, embedding.weight.dtype).to(embedding.weight.device)
    dense = embedding.weight.detach()
    for first in range(0, dense.shape[0], 4096):  # bounded scratch: 4096 rows at a time
        ids = torch.arange(first, min(first + 4096, dense.shape[0]), device=dense.device)
        if not same_bits(compact(ids), dense[first : first + 4096]):
            logger.info("embedding kept dense: its Q8_0 rows do not give the same bits")
            return False
    model.embed_tokens = compact
    dense_mib = dense.numel() * dense.element_size() / 2**20
    compact_mib = (rows.codes.numel() + rows.scales.numel() * 2) / 2**20
    logger.info(
        "tied embedding kept as Q8_0 rows (%.0f MiB, the head's dense copy %.0f MiB is no longer shared)",
        compact_mib, dense_mib,
    )  # fmt: skip
    return True


def embedding_dtype(embedding: nn.Module) -> torch.dtype:
    """The dtype an embedding's rows come out in (a Q8Embedding's dense weight is not at hand)."""
    if isinstance(embedding, Q8Embedding):
        return embedding.dtype
    weight = embedding.weight
    assert isinstance(weight, torch.Tensor)
    return weight.dtype
