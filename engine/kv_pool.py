"""The physical KV cache: one tensor, one block per page.

Dimensions: N blocks (pages), L layers with K/V (a hybrid's attention layers only), 2 (key, value), T tokens per block, H kv heads, D head dim.

    data [N, L, 2, T, H, D], contiguous

With KV groups (engine/kv_groups.py) L is S, the layers of one group: every group's page has the
same size, and page b holds S layers of whichever group owns it now (`GroupedKVPool`).

Block b is the byte range [b * page_bytes, (b + 1) * page_bytes) from `data_ptr()`: a page holds
every layer's keys and values for T tokens, and adjacent block ids are adjacent in memory, so a
run of adjacent pages moves as one message. The allocator decides which ids are used; this class
only stores and copies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import CacheConfig
from engine.kv_cache import CopyOp
from engine.kv_group_tables import KVGroup, make_kv_groups
from engine.models.config import ModelConfig
from engine.region_pages import RegionPages
from engine.types import KVRegion

logger = logging.getLogger(__name__)

KEY = 0
VALUE = 1


class KVPool:
    @staticmethod
    def page_bytes_for(
        model_config: ModelConfig, tokens_per_block: int, dtype: torch.dtype, num_layers: int | None = None
    ) -> int:
        """Bytes of one page (one block of every layer's keys and values, or of num_layers
        layers: a KV group's) before any pool exists."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        num_layers = model_config.num_kv_layers if num_layers is None else num_layers
        return (
            num_layers * 2 * tokens_per_block * model_config.num_key_value_heads
            * model_config.head_dim * element_bytes
        )  # fmt: skip

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        num_layers: int | None = None,
    ) -> None:
        """num_layers: the layer slots of a page (S of KV groups; None: every KV layer)."""
        self.model_config = model_config
        self.cache_config = cache_config
        self.tokens_per_block = cache_config.tokens_per_block
        shape = (
            cache_config.num_blocks,
            model_config.num_kv_layers if num_layers is None else num_layers,
            2,
            cache_config.tokens_per_block,
            model_config.num_key_value_heads,
            model_config.head_dim,
        )
        # Zeroed rather than empty: a page that is read before it is written (a bug) shows as
        # zeros, not as whatever the allocator left there, and tests stay deterministic.
        self.data = torch.zeros(shape, dtype=dtype, device=device)  # [N, L, 2, T, H, D]

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def page_bytes(self) -> int:
        return int(self.data[0].numel() * self.data.element_size())

    def group_of_layer(self, layer: int) -> int:
        """Every layer's KV group: the one group of a pool of every layer."""
        del layer
        return 0

    def layer_view(self, layer: int) -> torch.Tensor:
        """Keys and values of one layer across all blocks, a strided view: [N, 2, T, H, D]."""
        return self.data[:, layer]

    def copy_blocks(self, copies: Sequence[CopyOp]) -> None:
        """Copies whole pages (all layers, K and V): dst <- src for each copy, in one gather.

        Sources are read before any destination is written, so a copy list may chain
        (a block that is a destination of one copy may be the source of another).
        """
        if not copies:
            return
        sources = {copy.src_block for copy in copies}
        if not any(copy.dst_block in sources for copy in copies):
            # No chain: each page straight into its destination. The gather below copies every
            # page twice (into a temporary, then out of it): a beam step's copy-on-write of
            # partial last pages (1.5 MB each for SmolLM2 in float32) runs at half the traffic.
            for copy in copies:
                self.data[copy.dst_block].copy_(self.data[copy.src_block])
            return
        src_ids = torch.tensor([copy.src_block for copy in copies], dtype=torch.long, device=self.device)
        dst_ids = torch.tensor([copy.dst_block for copy in copies], dtype=torch.long, device=self.device)
        self.data[dst_ids] = self.data[src_ids]

    def region(self) -> KVRegion:
        return KVRegion(
            address=int(self.data.data_ptr()),
            page_bytes=self.page_bytes,
            num_pages=self.num_blocks,
            device=str(self.device),
        )


@dataclass(frozen=True)
class PoolLayout:
    """What GroupedKVPool.build decided: the groups, the cache config (num_blocks: the one pool's
    pages) and the bytes of one page."""

    groups: tuple[KVGroup, ...]
    cache_config: CacheConfig
    page_bytes: int
    pool: GroupedKVPool


class GroupedKVPool:
    """One KVPool whose pages hold S layer slots, shared by every KV group (engine/kv_groups.py):
    layer l of group g lives in slot `layer_indices.index(l)` of the pages group g's tables name,
    and a page belongs to one group at a time (the shared allocator's owner). A model asks for a
    KV layer by its model-wide index. One group: exactly a single KVPool of every layer."""

    def __init__(self, pool: KVPool, groups: Sequence[KVGroup]) -> None:
        if not groups:
            raise ValueError("no KV groups")
        num_slots = max(len(group.layer_indices) for group in groups)
        if num_slots != pool.data.shape[1]:
            raise ValueError(
                f"pages of {pool.data.shape[1]} layer slots for groups of up to {num_slots} layers"
            )
        self.pool = pool
        self.groups = tuple(groups)
        self.tokens_per_block = pool.tokens_per_block
        self.region_pages = RegionPages(pool.tokens_per_block, tuple(group.window for group in groups))
        # layer -> (group, slot in the page)
        self._where = {
            layer: (group, slot)
            for group, kv_group in enumerate(groups)
            for slot, layer in enumerate(kv_group.layer_indices)
        }

    @staticmethod
    def build(
        model_config: ModelConfig,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        extra_page_bytes: int = 0,
    ) -> PoolLayout:
        """The model's KV groups (make_kv_groups, honouring cache.sliding_window_kv) and the one
        pool: a memory budget divided by the page bytes, no split between groups.
        extra_page_bytes: stored next to each page (a hybrid's state snapshot), counted in its size."""
        groups = make_kv_groups(model_config.kv_layer_windows, cache.sliding_window_kv)
        num_slots = max(len(group.layer_indices) for group in groups)
        page_bytes = (
            KVPool.page_bytes_for(model_config, cache.tokens_per_block, dtype, num_slots) + extra_page_bytes
        )
        config = cache.fitted_to(page_bytes)
        if config.num_blocks != cache.num_blocks and not cache.is_sized_by_memory:
            logger.info(
                "KV pool: %d blocks of %.2f MiB fit in max_pool_bytes %d (asked for %d)",
                config.num_blocks, page_bytes / 2**20, cache.max_pool_bytes, cache.num_blocks,
            )  # fmt: skip
        pool = KVPool(model_config, config, dtype, device, num_slots)
        return PoolLayout(groups, config, page_bytes, GroupedKVPool(pool, groups))

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def group_of_layer(self, layer: int) -> int:
        return self._where[layer][0]

    def layer_view(self, layer: int) -> torch.Tensor:
        """[N, 2, T, H, D]: the layer's slot of every page (its group's pages are the ones its
        group's block tables name)."""
        return self.pool.layer_view(self._where[layer][1])

    def copy_blocks(self, copies: Sequence[Sequence[CopyOp]]) -> None:
        """copies[g]: group g's copies; the groups' pages are disjoint, so one gather does all."""
        self.pool.copy_blocks([copy for group_copies in copies for copy in group_copies])

    @property
    def data(self) -> torch.Tensor:
        """[N, S, 2, T, H, D]"""
        return self.pool.data

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def page_bytes(self) -> int:
        return self.pool.page_bytes

    def region(self) -> KVRegion:
        """The transfer region: the one pool, a page per block (engine/region_pages.py)."""
        return self.pool.region()
