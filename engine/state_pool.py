"""The recurrent state of a hybrid model's convolution layers: running slots and block snapshots.

Dimensions: S slots, C convolution layers, R = conv_kernel_size - 1 past inputs kept per layer,
E hidden size, N KV blocks.

    slots     [S, C, R, E]  one per live beam of a request (and per pinned prompt, context side)
    snapshots [N, C, R, E]  snapshots[b]: the state right after the last token of KV block b

A snapshot lives at the index of the KV block whose end it marks, so it needs no allocator of its
own and never outlives its block; the prefix tree records which blocks hold one and how many
tokens it covers (engine/prefix_tree.py). Slot ids are plain Python, handed out lowest first.
Like KVPool, this class stores and copies; which slot a beam uses is the caller's bookkeeping.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from engine.block_allocator import OutOfBlocksError
from engine.models.config import ModelConfig


class OutOfStateSlotsError(OutOfBlocksError):
    """Not enough free state slots; raised with the pool exactly as before the call."""


class StatePool:
    @staticmethod
    def state_bytes_for(model_config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one state (a slot, or a block's snapshot) before any pool exists; 0 without
        recurrent layers."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        num_layers = len(model_config.conv_layer_indices)
        return num_layers * model_config.state_width * model_config.hidden_size * element_bytes

    def __init__(
        self,
        model_config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        shape = (len(model_config.conv_layer_indices), model_config.state_width, model_config.hidden_size)
        self.slots = torch.zeros((num_slots, *shape), dtype=dtype, device=device)  # [S, C, R, E]
        self.snapshots = torch.zeros((num_blocks, *shape), dtype=dtype, device=device)  # [N, C, R, E]
        self._free_heap = list(range(num_slots))

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state at one position (one slot)."""
        return int(self.slots[0].numel() * self.slots.element_size())

    def num_free_slots(self) -> int:
        return len(self._free_heap)

    # -- slots -------------------------------------------------------------------------------
    def allocate_slots(self, num_slots: int) -> list[int]:
        """All or none; the slots' contents are undefined until `reset`, `fork` or `write`."""
        if num_slots > len(self._free_heap):
            raise OutOfStateSlotsError(f"need {num_slots} state slots, {len(self._free_heap)} free")
        return [heapq.heappop(self._free_heap) for _ in range(num_slots)]

    def free_slots(self, slot_ids: Iterable[int]) -> None:
        for slot_id in slot_ids:
            if slot_id in self._free_heap:
                raise ValueError(f"state slot {slot_id} is already free")
            heapq.heappush(self._free_heap, slot_id)

    def reset(self, slot_id: int, snapshot_block_id: int | None) -> None:
        """The state before a prompt's first uncached token: a block's snapshot, or zeros at
        position 0 (what the reference's left zero padding of the convolution means)."""
        if snapshot_block_id is None:
            self.slots[slot_id].zero_()
        else:
            self.slots[slot_id] = self.snapshots[snapshot_block_id]

    def fork(self, slot_ids: Sequence[int], parent_indices: Sequence[int]) -> None:
        """Beam i now continues beam parent_indices[i]: slot_ids[i] <- slot_ids[parent], all read
        before any is written (one gather), so parents may be overwritten by their children."""
        if list(parent_indices) == list(range(len(slot_ids))):
            return
        sources = torch.tensor([slot_ids[parent] for parent in parent_indices], device=self.slots.device)
        targets = torch.tensor(list(slot_ids[: len(parent_indices)]), device=self.slots.device)
        self.slots[targets] = self.slots[sources]

    def read(self, slot_id: int) -> bytes:
        """One slot as raw bytes in the pool's dtype (what a context worker ships)."""
        return self.slots[slot_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def write(self, slot_id: int, state: bytes) -> None:
        if len(state) != self.state_bytes:
            raise ValueError(f"a recurrent state holds {self.state_bytes} bytes, got {len(state)}")
        raw = torch.frombuffer(bytearray(state), dtype=torch.uint8).to(self.slots.device)
        self.slots[slot_id] = raw.view(self.slots.dtype).view(self.slots[slot_id].shape)

    # -- snapshots ---------------------------------------------------------------------------
    def save_snapshot(self, slot_id: int, block_id: int) -> None:
        self.snapshots[block_id] = self.slots[slot_id]

    def copy_snapshot(self, src_block_id: int, dst_block_id: int) -> None:
        self.snapshots[dst_block_id] = self.snapshots[src_block_id]

    def check_integrity(self, live_slot_ids: Iterable[int]) -> None:
        """Every slot is free or held by exactly one live beam or pinned prompt."""
        free = Counter(self._free_heap)
        assert all(count == 1 for count in free.values()), "state slot free twice"
        held = Counter(live_slot_ids)
        assert all(count == 1 for count in held.values()), f"state slot held twice: {held.most_common(1)}"
        assert not set(held) & set(free), "state slot both free and held"
        assert len(held) + len(free) == self.num_slots, (
            f"free {len(free)} + held {len(held)} state slots != {self.num_slots}"
        )
