"""The decoder's norms: RMSNorm (Llama's, in float32 whatever the dtype, or one compiled call where
the engine loaded engine/native/kernels.cpp) and Gemma's offset RMSNorm.

A norm after a residual add can take the add with it (`RMSNorm.add_and_norm`, one compiled call
with the bits of the two apart): engine/models/decoder.py's layers pass (residual, delta) pairs
for that where their norms are plain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.models.config import ModelConfig

# Dtypes whose RMSNorm may run the compiled kernel (float64 keeps torch's ops: its parity with
# transformers is held to 1e-12, and the kernel's mean square sums in another order).
NATIVE_NORM_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    # torch.ops.beamsplit.rms_norm where the engine loaded it (use_native_norms): one call for the
    # forward below, the mean square summed in a fixed order per row (engine/native/kernels.cpp);
    # native_add (add_rms_norm): the residual add before it and the norm in one call, same bits.
    native: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
    native_add: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if (
            self.native is not None
            and hidden.dtype in NATIVE_NORM_DTYPES
            and hidden.dtype == self.weight.dtype
        ):
            # Whatever the layout (a lone row's view of a fused projection is contiguous, a batch's
            # is not): the path must not depend on the batch.
            return self.native(hidden.contiguous(), self.weight, self.eps)
        # Normalised in float32 whatever the dtype, as the reference does; float64 included.
        input_dtype = hidden.dtype
        hidden32 = hidden.to(torch.float32)
        variance = hidden32.pow(2).mean(-1, keepdim=True)
        normalised = hidden32 * torch.rsqrt(variance + self.eps)
        return self.weight * normalised.to(input_dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm): one compiled call where the engine loaded it, with the
        bits of the add and forward apart."""
        if (
            self.native_add is not None
            and residual.dtype in NATIVE_NORM_DTYPES
            and residual.dtype == delta.dtype == self.weight.dtype
        ):
            return self.native_add(residual.contiguous(), delta.contiguous(), self.weight, self.eps)
        summed = residual + delta
        return summed, self(summed)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), the product in float32 too, then casts back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden32 = hidden.to(torch.float32)
        normalised = hidden32 * torch.rsqrt(hidden32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normalised * (1.0 + self.weight.to(torch.float32))).to(hidden.dtype)


def use_native_norms(
    model: nn.Module,
    kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    add_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Every RMSNorm of `model` runs `kernel` (engine/native_kernels.norm_kernel) from now on, and
    `add_kernel` (add_norm_kernel) for a residual add and the norm after it where given."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.native = kernel
            module.native_add = add_kernel


def make_norm(config: ModelConfig, width: int) -> nn.Module:
    return (OffsetRMSNorm if config.traits.norm_offset else RMSNorm)(width, config.rms_norm_eps)
