"""What this host's oneDNN build can pack: tests of the packed paths ask before they pack.

oneDNN's bfloat16 inner product needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU
packing a bfloat16 weight raises, every oneDNN check says no and the engine keeps those layers on
its other batch-invariant paths (engine/onednn_calls.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import onednn_calls, panel_linear

NO_BFLOAT16_REASON = (
    "this CPU's oneDNN has no bfloat16 inner product (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Can a weight of `dtype` be packed and multiplied by oneDNN here?"""
    try:
        packed = onednn_calls.pack_onednn_weight(torch.ones(16, 16, dtype=dtype))
        onednn_calls.onednn_inner_product(torch.ones(4, 16, dtype=dtype), packed)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def onednn_linear_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 linear layers on oneDNN's packed path, on every host: tests of that path and its
    checks (on a CPU without AVX-512 the engine would pick the panel kernel, engine/panel_linear.py)."""
    monkeypatch.setenv(panel_linear.KERNEL_ENV, "onednn")
