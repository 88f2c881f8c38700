"""One GGUF tensor -> the Hugging Face tensor(s) it was converted from (names without `model.`).

What llama.cpp's converter did, undone here per architecture (see architectures.py):
- llama's q and k rows: each head's two rotary halves interleaved (row pairs (j, j + D/2) became
  (2j, 2j + 1)) for llama.cpp's rope kernel; the engine rotates halves, so the rows go back:

      per head, GGUF row 2j   -> row j          j in [0, D/2)
                GGUF row 2j+1 -> row j + D/2

- Gemma's RMSNorm weights: stored as 1 + w (llama.cpp's norm multiplies by the weight; Gemma's
  by 1 + weight); w = stored - 1 in float32, as transformers' GGUF loader computes it, so both
  models hold the same bits.
- Qwen3-MoE experts: `blk.{i}.ffn_{gate,up,down}_exps` [experts, out, in] -> one 2-D tensor per
  expert, `layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import torch

from engine.models.gguf_checkpoint.architectures import TOP_TENSORS, Architecture
from engine.models.gguf_checkpoint.metadata import Metadata


def hf_tensors(
    meta: Metadata,
    architecture: Architecture,
    config: dict[str, object],
    gguf_name: str,
    values: torch.Tensor,
) -> list[tuple[str, torch.Tensor]]:
    """`values` (float32, the file's shape) under Hugging Face names, converted back."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in TOP_TENSORS:
        name = f"{TOP_TENSORS[parts[0]]}.{parts[1]}"
        return [(name, _shift_norm(architecture, name, values))]
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        _, layer, kind, suffix = parts
        if kind in architecture.expert_tensors and suffix == "weight":
            projection = architecture.expert_tensors[kind]
            return [
                (f"layers.{layer}.mlp.experts.{expert}.{projection}.weight", values[expert])
                for expert in range(values.shape[0])
            ]  # values: [experts, out, in]
        if kind in architecture.layer_tensors:
            name = f"layers.{layer}.{architecture.layer_tensors[kind]}.{suffix}"
            if architecture.is_rotary_interleaved and kind in ("attn_q", "attn_k") and suffix == "weight":
                heads = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
                assert isinstance(heads, int)
                values = undo_rotary_interleave(values, heads)
            return [(name, _shift_norm(architecture, name, values))]
    raise meta.error(f"tensor {gguf_name!r} is not part of a {architecture.name} model this engine runs")


def undo_rotary_interleave(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads * D, E] in llama.cpp's row order -> Hugging Face's (see the module docstring)."""
    rows, width = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, width).transpose(1, 2).reshape(rows, width)


def _shift_norm(architecture: Architecture, name: str, values: torch.Tensor) -> torch.Tensor:
    if architecture.norm_shift and name.endswith("norm.weight"):
        return values - architecture.norm_shift
    return values
