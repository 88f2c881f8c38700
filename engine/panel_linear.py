"""Linear layers in float32 on a CPU without AVX-512: our own kernel, batch-invariant by construction.

The weight [out, in] is held as panels [ceil(out / 16), in, 16] (zero columns past `out`), and
every output is one fused multiply-add chain over the input features in order, from zero
(engine/native/kernels.cpp, `panel_linear`). Tiling, threads and the row count decide which
outputs are computed together, never an output's bits: a row's outputs are the same alone or in
any batch (no kernel check is needed), and q, k and v fused into one set of panels give each
column the bits it has apart.

Where it is used (`panels_apply`): float32 on a CPU whose ATen capability is AVX2 (no AVX-512),
with the native library built. There, on the 2-core AMD EPYC (Zen 3) VM of issue 29, the 135M
model's 121 linear shapes took 25-26 ms for 4 rows against oneDNN's 34-37, 131-139 ms for 64
rows against 161-167, and 1.06-1.19 s for 600 rows against 1.24-1.27 (docs/engine.md, "Linear
layers on AVX2"). With AVX-512, oneDNN's kernels use twice the vector width: they stay.
`BEAMSPLIT_LINEAR_KERNEL` overrides the choice: `panels` or `onednn` (benchmarks, tests).
"""

from __future__ import annotations

import os

import torch

import engine.native_kernels as native_kernels

PANEL_COLUMNS = 16  # output features per panel (two 8-lane vectors)
KERNEL_ENV = "BEAMSPLIT_LINEAR_KERNEL"
KERNEL_CHOICES = ("panels", "onednn")


def panels_apply(dtype: torch.dtype, device_type: str) -> bool:
    """Do linear layers of this dtype and device take the panel kernel in this process?"""
    if dtype != torch.float32 or device_type != "cpu":
        return False
    choice = os.environ.get(KERNEL_ENV, "")
    if choice and choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected one of {', '.join(KERNEL_CHOICES)} (or unset)")
    if choice == "onednn":
        return False
    if not choice and torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    return native_kernels.panel_linear_kernel() is not None


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A dense weight [out, in] as panels [ceil(out / 16), in, 16], zero past `out`."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_COLUMNS)
    padded = weight.new_zeros(num_panels * PANEL_COLUMNS, in_features)
    padded[:out_features] = weight.detach()
    return padded.reshape(num_panels, PANEL_COLUMNS, in_features).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense weight [out, in] that `to_panels` made `panels` of (a copy, exact)."""
    num_panels, in_features, _ = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * PANEL_COLUMNS, in_features)[:out_features].contiguous()


def panel_linear(rows: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """rows [M, in] float32 -> [M, out] through the panels (no bias)."""
    kernel = native_kernels.panel_linear_kernel()
    if kernel is None:
        raise RuntimeError("the panel kernel needs the native library, which could not be built")
    output: torch.Tensor = kernel(rows, panels, out_features)
    return output
