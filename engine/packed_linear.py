"""Kernel warm-up at load: every per-shape check measured and every linear weight packed, once.

engine/batch_invariant.py picks each linear layer's kernel from measurements made in the running
process (once per shape, dtype and thread count) and runs oneDNN's inner product, fastest with
the weight in oneDNN's blocked layout. Done lazily, both land on the first request after the
server reports healthy: the checks run the LM head's shape a dozen times, and packing copies
every weight. `warm_up_linear_layers` does both before the engine is handed out:
- it runs the checks for every linear layer's shape at the current thread count;
- where oneDNN's path is taken, it replaces the layer by a PackedLinear that holds the weight
  packed and nothing else (one copy, not two: the dense weight is dropped). A packed weight is
  an opaque oneDNN tensor; `PackedLinear.weight` unpacks it on demand (a product with the
  identity, exact: every output is 1 x w plus zeros) for the rare reader of the dense weight
  (a thread count whose check fails, a state_dict). A head tied to the embedding keeps the dense
  tensor the embedding owns anyway, and holds the packed copy beside it.

Dimensions: M rows, in and out features.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import engine.batch_invariant as batch_invariant
import engine.huge_pages as huge_pages
import engine.onednn_calls as onednn_calls
import engine.panel_linear as panel_linear
from engine.kernel_facts import CheckChild, is_known, measure_in_child

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """A bias-free or biased linear layer whose weight lives only in a packed layout: oneDNN's, or
    the panel kernel's where that applies (float32 without AVX-512: engine/panel_linear.py).

    Rows are independent of each other as in RowChunkedLinear. Panels keep them apart by
    construction. With oneDNN's layout, where its check holds (it did at packing; the thread count
    may change since), every row goes through one inner-product call; otherwise through
    invariant_linear's other paths with the weight unpacked."""

    def __init__(
        self,
        packed_weight: torch.Tensor,
        bias: nn.Parameter | None,
        shared: torch.Tensor | None,
        chunked: bool = False,
        out_features: int | None = None,
    ) -> None:
        """packed_weight: [out, in] from pack_onednn_weight, or panels [ceil(out / 16), in, 16] from
        to_panels with `out_features`; shared: the dense weight when another module owns it too (a
        tied embedding), else None; chunked: rows go in oneDNN calls of onednn_call_sizes' row
        counts wherever that check holds, even where the any-M one does too (a fused layer whose
        parts take them: engine/fused_projections.py)."""
        super().__init__()
        self.chunked = chunked
        self.panels = not packed_weight.is_mkldnn
        if self.panels:
            assert out_features is not None, "panels need out_features"
            self.out_features, self.in_features = out_features, packed_weight.shape[1]
        else:
            self.out_features, self.in_features = packed_weight.shape
        self.packed_weight = packed_weight
        self.bias = bias
        self._shared = shared
        # The thread count at which the any-M check was last seen to hold for this (unchunked)
        # layer: forward then makes the one call straight away. A decode step makes 121 of these
        # calls; the shape key and the check's lookup cost about 6 us of each.
        self._independent_at: int | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, shared: bool, chunked: bool = False) -> PackedLinear:
        weight = linear.weight.detach()
        if panel_linear.panels_apply(weight.dtype, weight.device.type):
            panels = panel_linear.to_panels(weight)
            return cls(panels, linear.bias, weight if shared else None, chunked, weight.shape[0])
        return cls(onednn_calls.pack_onednn_weight(weight), linear.bias, weight if shared else None, chunked)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in]: the shared one, else unpacked (exact, costs in*in*out)."""
        if self._shared is not None:
            return self._shared
        if self.panels:
            return panel_linear.from_panels(self.packed_weight, self.out_features)
        identity = torch.eye(self.in_features, dtype=self.packed_weight.dtype)  # [in, in]
        return onednn_calls.onednn_inner_product(identity, self.packed_weight).t().contiguous()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2:
            raise ValueError(f"PackedLinear takes [rows, features], got shape {tuple(hidden.shape)}")
        if self.panels:
            product = panel_linear.panel_linear(hidden, self.packed_weight, self.out_features)
            return product if self.bias is None else product + self.bias
        threads = torch.get_num_threads()
        if threads == self._independent_at and hidden.shape[0] >= onednn_calls.ONEDNN_MIN_ROWS:
            output: torch.Tensor | None = onednn_calls.onednn_inner_product(hidden, self.packed_weight)
        else:
            output = self._checked_call(hidden, threads)
        if output is not None:
            return output if self.bias is None else output + self.bias
        return batch_invariant.invariant_linear(hidden, self.weight, self.bias)

    def _checked_call(self, hidden: torch.Tensor, threads: int) -> torch.Tensor | None:
        """forward's oneDNN call(s) as its checks route them at `threads`, or None where neither
        holds; notes the thread count where the any-M call may be made without asking again."""
        shape = (self.in_features, self.out_features, self.packed_weight.dtype, hidden.device.type, threads)
        sizes = onednn_calls.onednn_call_sizes(*shape) if self.chunked else ()
        if sizes:
            return onednn_calls.onednn_chunked(hidden, self.packed_weight, sizes)
        if hidden.device.type == "cpu" and onednn_calls.onednn_rows_are_independent(*shape):
            self._independent_at = threads
        return onednn_calls.onednn_linear_if_independent(hidden, self.packed_weight, shape)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


KernelShape = tuple[int, int, torch.dtype, str, int]  # in and out features, dtype, device type, threads


def linear_shape(module: nn.Module, num_threads: int) -> KernelShape | None:
    """The kernel shape a linear layer of the batch-invariant model asks its checks for."""
    if isinstance(module, PackedLinear):
        return (module.in_features, module.out_features, module.packed_weight.dtype, "cpu", num_threads)
    if isinstance(module, batch_invariant.RowChunkedLinear):
        weight = module.weight
        return (weight.shape[1], weight.shape[0], weight.dtype, weight.device.type, num_threads)
    return None


def takes_packed_path(
    in_features: int, out_features: int, dtype: torch.dtype, device_type: str, num_threads: int
) -> bool:
    """Does a linear layer of this shape get packed: as panels where they apply (no check asked),
    else where takes_onednn_path says so?"""
    if panel_linear.panels_apply(dtype, device_type):
        return True
    return takes_onednn_path(in_features, out_features, dtype, device_type, num_threads)


def takes_onednn_path(
    in_features: int, out_features: int, dtype: torch.dtype, device_type: str, num_threads: int
) -> bool:
    """Runs the checks a linear layer of this shape asks, in invariant_linear's order; True where it
    takes oneDNN's path (and gets packed)."""
    shape = (in_features, out_features, dtype, device_type, num_threads)
    if onednn_calls.onednn_rows_are_independent(*shape) or onednn_calls.onednn_call_sizes(*shape):
        return True
    # The MKL paths' checks, as invariant_linear asks them (all False on a GPU, at no cost).
    if batch_invariant.rows_are_independent(*shape):
        batch_invariant.columns_are_independent(*shape)
    return False


def linear_checks(model: nn.Module, num_threads: int) -> list[tuple[Callable[..., bool], KernelShape]]:
    """The checks warm_up_linear_layers will ask for the model's linear layers and this process
    has not measured yet, each shape once (as calls of takes_onednn_path)."""
    shapes = {shape: None for module in model.modules() if (shape := linear_shape(module, num_threads))}
    return [
        (takes_onednn_path, shape)
        for shape in shapes
        if not panel_linear.panels_apply(shape[2], shape[3])
        and not is_known(onednn_calls.onednn_rows_are_independent, *shape)
    ]


# The modules whose checks a warm-up asks (fusion's import this one's)
CHECK_MODULES = ("engine.packed_linear", "engine.fused_projections")


def checks_in_child(
    calls: Sequence[tuple[Callable[..., bool], tuple[Any, ...]]], child: CheckChild | None, start: bool
) -> bool:
    """Runs `calls` (linear_checks', fusion_checks') in a child process (engine/kernel_facts.py):
    `child` if one was started for them (closed unasked where there is nothing to run), else a
    new one where `start` (the engine's decision: LLMEngine._start_check_child); True where the
    child measured them. Checks for another device than the CPU run here."""
    runnable = bool(calls) and all(args[3] == "cpu" for _, args in calls)
    if child is not None:
        if runnable:
            return child.measure(calls, torch.get_num_threads())
        child.close()
        return False
    return start and runnable and measure_in_child(calls, torch.get_num_threads())


def warm_up_linear_layers(model: nn.Module) -> int:
    """Runs every kernel check the model's linear layers will ask for at this thread count, and
    packs (replaces by PackedLinear) those that take a packed path (takes_packed_path); returns how many layers are
    packed. The model's linear layers are RowChunkedLinear (make_batch_invariant) or already
    packed; call it again from a thread that computes with another thread count."""
    started = time.monotonic()
    embedding_weights = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    num_threads = torch.get_num_threads()
    num_packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            shape = linear_shape(child, num_threads)
            if shape is None or not takes_packed_path(*shape):
                continue
            if isinstance(child, batch_invariant.RowChunkedLinear):
                child = PackedLinear.from_linear(child, shared=id(child.weight) in embedding_weights)
                setattr(parent, name, child)
            num_packed += 1
    num_panels = sum(1 for module in model.modules() if isinstance(module, PackedLinear) and module.panels)
    logger.info(
        "kernel checks at %d threads, weights packed: %d linear layers (%d as panels, "
        "engine/panel_linear.py; the others for oneDNN), in %.1f s",
        num_threads, num_packed, num_panels, time.monotonic() - started,
    )  # fmt: skip
    return num_packed


def collapse_packed_weights(model: nn.Module) -> tuple[int, int]:
    """Puts the model's packed weights on huge pages where the system can (engine/huge_pages.py),
    logged; returns (bytes collapsed, bytes packed)."""
    started = time.monotonic()
    spans = {
        _packed_span(module.packed_weight)
        for module in model.modules()
        if isinstance(module, PackedLinear) and module.packed_weight.device.type == "cpu"
    }
    collapsed = sum(huge_pages.collapse(address, num_bytes) for address, num_bytes in spans)
    packed = sum(num_bytes for _, num_bytes in spans)
    if packed:
        logger.info(
            "packed weights on 2 MiB pages: %d of %d MiB, in %.1f s (engine/huge_pages.py)",
            collapsed >> 20, packed >> 20, time.monotonic() - started,
        )  # fmt: skip
    return collapsed, packed


def _packed_span(weight: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a packed weight's storage: oneDNN's buffer, or a dense tensor's."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(weight), torch.ops.mkldnn._nbytes(weight)
    return weight.data_ptr(), weight.numel() * weight.element_size()


def bytes_held(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers, packed weights), each counted
    once: what the weights cost in memory, whatever their layout."""
    seen: set[int] = set()
    total = 0
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    tensors.extend(module.packed_weight for module in model.modules() if isinstance(module, PackedLinear))
    for tensor in tensors:
        key = id(tensor) if tensor.is_mkldnn else tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += (
            tensor.numel() * tensor.element_size() if tensor.is_mkldnn else tensor.untyped_storage().nbytes()
        )
    return total


def dense_weight_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state dict's tensors, each storage once (tied weights count once)."""
    storages = {
        tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in state.values()
    }
    return sum(storages.values())
