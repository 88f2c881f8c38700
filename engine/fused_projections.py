"""Packed projections fused at load: q, k, v as one oneDNN weight, and gate with up, where the bits stay.

A decode step of a small model at a few rows is many small oneDNN calls: 7 linear layers per
decoder layer, each paying its call, its output and its threads' wake-up. Measured on the
135M model's shapes (4 rows, 2 threads, issue 29): q, k and v (576 -> 576, 192, 192) took
120 us apart and 79 us as one 576 -> 960 call in float32, 112 and 34 us in bfloat16; gate and
up (576 -> 1536 twice) 308 against 274 us, and 237 against 202.

oneDNN's inner product reduces each output over K in one order, whatever the output width, on
the hosts measured here; that is measured, not assumed: `fusion_is_exact` compares, once per
shape, dtype and thread count in the running process, every row's outputs from the fused weight
with the separate layers' (both through PackedLinear's path for their shapes, for row counts
from 1 to 300). Only where they are equal bit for bit are the layers fused, so a fused model
computes exactly what the separate one does (and a worker that did not fuse agrees with one that
did). A layer keeps its names' meaning: `qkv_proj` / `gate_up_proj` as the fused families name
them, with the split the decoder already has for those families (engine/models/decoder.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import engine.onednn_calls as onednn_calls
import engine.panel_linear as panel_linear
from engine.kernel_facts import is_known, kernel_check
from engine.packed_linear import PackedLinear, linear_shape, takes_onednn_path

logger = logging.getLogger(__name__)

# (the fused layer's name, the separate layers' names, the decoder method that reads them fused / apart)
FUSIONS = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj"), "project", "_project_fused", "_project_apart"),
    ("gate_up_proj", ("gate_proj", "up_proj"), "gate_up", "_gate_up_fused", "_gate_up_apart"),
)


@kernel_check
def fusion_is_exact(
    in_features: int, out_features: tuple[int, ...], dtype: torch.dtype, device_type: str, num_threads: int
) -> bool:
    """Do rows through one packed [sum(out), in] weight give each of the separate packed
    [out_i, in] layers' outputs, bit for bit, at every row count? Checked here once per shape."""
    if device_type != "cpu" or num_threads != torch.get_num_threads():
        return False
    generator = torch.Generator().manual_seed(6)
    weights = [torch.randn(out, in_features, generator=generator).to(dtype) for out in out_features]
    rows = torch.randn(300, in_features, generator=generator).to(dtype)
    chunked = takes_chunks(in_features, out_features, dtype, num_threads)
    try:
        separate = [PackedLinear.from_linear(_linear(weight), shared=False) for weight in weights]
        fused = PackedLinear.from_linear(_linear(torch.cat(weights)), shared=False, chunked=chunked)
    except RuntimeError:  # no oneDNN inner product for this dtype
        return False
    for first, count in ((0, 1), (3, 4), (1, 5), (0, 32), (7, 33), (0, 300)):
        part = rows[first : first + count]
        if not torch.equal(fused(part), torch.cat([layer(part) for layer in separate], dim=1)):
            return False
    return True


def takes_chunks(
    in_features: int, out_features: tuple[int, ...], dtype: torch.dtype, num_threads: int
) -> bool:
    """Does any of the separate layers take oneDNN's chunked calls (its any-M check fails)? Then
    the fused layer takes them too, whatever its own shape's checks say: the two paths give a row
    other bits past 32 rows on the AMX host in bfloat16 (where 300 rows were too few for the
    any-M check to see it, 576 -> 960 passed it while 576 -> 576 and 576 -> 192 did not).
    Panels (engine/panel_linear.py) take no chunks."""
    if panel_linear.panels_apply(dtype, "cpu"):
        return False
    return not all(
        onednn_calls.onednn_rows_are_independent(in_features, out, dtype, "cpu", num_threads)
        for out in out_features
    )


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


@dataclass(frozen=True)
class FusionSet:
    """One module's q/k/v or gate/up set, as the model holds it now."""

    module: nn.Module
    fusion: tuple[str, tuple[str, ...], str, str, str]  # a row of FUSIONS
    fused: bool  # one fused layer (ours, or the checkpoint's), else the separate layers
    shape: tuple[int, tuple[int, ...], torch.dtype, str, int]  # in, the parts' widths, dtype, "cpu", threads


def fusion_sets(model: nn.Module, num_threads: int) -> Iterator[FusionSet]:
    """Every set fuse_packed_projections may fuse or split, with the shape fusion_is_exact is asked
    for; linear layers packed or not yet (fusion_checks asks before packing). Left out: a layer
    fused in the checkpoint without our widths (Phi-3: not ours to split), and parts where some
    have a bias and some not (a zero bias would turn a -0.0 output into +0.0)."""
    for module in list(model.modules()):
        for fusion in FUSIONS:
            fused_name, names, method, fused_method, _ = fusion
            if not hasattr(module, fused_method):
                continue
            fused_shape = linear_shape(getattr(module, fused_name, nn.Identity()), num_threads)
            if fused_shape is not None and getattr(module, method) == getattr(module, fused_method):
                in_features, out_features, dtype, *_ = fused_shape
                widths = _widths(module, out_features)
                if widths is not None:
                    yield FusionSet(module, fusion, True, (in_features, widths, dtype, "cpu", num_threads))
                continue
            parts = [getattr(module, name, None) for name in names]
            shapes = [linear_shape(part, num_threads) for part in parts if isinstance(part, nn.Module)]
            if len(shapes) != len(names) or None in shapes:
                continue
            if len({part.bias is None for part in parts if isinstance(part, nn.Module)}) > 1:
                continue
            in_features, _, dtype, *_ = shapes[0]  # type: ignore[misc]
            widths = tuple(shape[1] for shape in shapes if shape is not None)
            yield FusionSet(module, fusion, False, (in_features, widths, dtype, "cpu", num_threads))


def fuse_packed_projections(model: nn.Module) -> int:
    """Fuses, in place, every q/k/v and gate/up set of PackedLinear layers where fusion_is_exact
    holds at this thread count, and splits a fused set again where it does not (a warm-up at
    another thread count); returns the fused sets now in the model."""
    num_threads = torch.get_num_threads()
    num_fused = 0
    for found in fusion_sets(model, num_threads):
        module, (fused_name, names, method, fused_method, apart_method) = found.module, found.fusion
        in_features, widths, dtype, *_ = found.shape
        if found.fused:
            fused = getattr(module, fused_name)
            if not isinstance(fused, PackedLinear):
                continue
            if fusion_is_exact(*found.shape):
                fused.chunked = takes_chunks(in_features, widths, dtype, num_threads)
                num_fused += 1
                continue
            _split(module, fused_name, fused, names, widths)
            setattr(module, method, getattr(module, apart_method))
            continue
        layers = [getattr(module, name) for name in names]
        if not all(isinstance(layer, PackedLinear) for layer in layers) or not fusion_is_exact(*found.shape):
            continue
        setattr(module, fused_name, _fuse(layers, takes_chunks(in_features, widths, dtype, num_threads)))
        for name in names:
            delattr(module, name)
        module.fused_widths = widths  # type: ignore[assignment]
        setattr(module, method, getattr(module, fused_method))
        num_fused += 1
    for module in model.modules():
        for fused_name, *_ in FUSIONS:
            fused = getattr(module, fused_name, None)
            if (
                isinstance(fused, PackedLinear) and not fused.panels
            ):  # its checks, now rather than on a request
                takes_onednn_path(
                    fused.in_features, fused.out_features, fused.packed_weight.dtype, "cpu", num_threads
                )
    logger.info("fused projections at %d threads: %d sets", num_threads, num_fused)
    return num_fused


def fusion_checks(model: nn.Module, num_threads: int) -> list[tuple[Callable[..., bool], tuple[Any, ...]]]:
    """The checks fuse_packed_projections will ask for the model's sets (fusion_sets) and this
    process has not measured yet, each shape once: fusion_is_exact, then the fused layer's own
    kernel checks."""
    checks: dict[tuple[Callable[..., bool], tuple[Any, ...]], None] = {}
    for found in fusion_sets(model, num_threads):
        in_features, widths, dtype, *_ = found.shape
        if panel_linear.panels_apply(dtype, "cpu"):
            continue  # fusion_is_exact: a few panel calls, asked in this process when fusing
        if not is_known(fusion_is_exact, *found.shape):
            checks[(fusion_is_exact, found.shape)] = None
            checks[(takes_onednn_path, (in_features, sum(widths), dtype, "cpu", num_threads))] = None
    return list(checks)


def _widths(module: nn.Module, out_features: int) -> tuple[int, ...] | None:
    widths = getattr(module, "fused_widths", None)
    return widths if isinstance(widths, tuple) and sum(widths) == out_features else None


def _fuse(layers: list[PackedLinear], chunked: bool) -> PackedLinear:
    """One packed layer for rows [M, in] -> [M, sum(out)]: the dense weights unpacked (exact),
    concatenated and packed once; the separate packed weights are dropped."""
    weight = torch.cat([layer.weight for layer in layers])
    biases = [layer.bias.detach() for layer in layers if layer.bias is not None]
    bias = torch.cat(biases) if biases else None
    return PackedLinear.from_linear(_linear(weight, bias), shared=False, chunked=chunked)


def _split(
    module: nn.Module, fused_name: str, fused: PackedLinear, names: tuple[str, ...], widths: tuple[int, ...]
) -> None:
    weights = fused.weight.split(widths)
    biases = [None] * len(widths) if fused.bias is None else list(fused.bias.detach().split(widths))
    delattr(module, fused_name)
    for name, weight, bias in zip(names, weights, biases, strict=True):
        setattr(module, name, PackedLinear.from_linear(_linear(weight.contiguous(), bias), shared=False))
    del module.fused_widths
