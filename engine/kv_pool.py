"""The physical KV cache: one tensor, one block per page.

Dimensions: N blocks (pages), L layers with K/V (a hybrid's attention layers only), 2 (key, value), T tokens per block, H kv heads, D head dim.

    data [N, L, 2, T, H, D], contiguous

Block b is the byte range [b * page_bytes, (b + 1) * page_bytes) from `data_ptr()`: a page holds
every layer's keys and values for T tokens, and adjacent block ids are adjacent in memory, so a
run of adjacent pages moves as one message. The allocator decides which ids are used; this class
only stores and copies.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import CacheConfig
from engine.kv_cache import CopyOp
from engine.kv_group_sizing import group_cache_configs
from engine.kv_groups import KVGroup, make_kv_groups
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
        storage: torch.Tensor | None = None,
    ) -> None:
        """num_layers: the layers this pool's pages hold (a KV group's; None: every KV layer).
        storage: zeroed 1-D memory to lay the pages in (a share of GroupedKVPool's buffer)."""
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
        if storage is None:
            self.data = torch.zeros(shape, dtype=dtype, device=device)  # [N, L, 2, T, H, D]
        else:
            self.data = storage.view(shape)

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
    """What GroupedKVPool.build decided: the groups, each group's cache config (its num_blocks) and
    page bytes, and the pool."""

    groups: tuple[KVGroup, ...]
    cache_configs: tuple[CacheConfig, ...]
    group_page_bytes: tuple[int, ...]
    pool: GroupedKVPool


class GroupedKVPool:
    """One KVPool per KV group (engine/kv_groups.py) over that group's layers only; a model asks
    for a KV layer by its model-wide index and gets its group's page tensor. One group: a pool
    laid out exactly as a single KVPool."""

    def __init__(
        self,
        pools: Sequence[KVPool],
        layer_groups: Sequence[Sequence[int]],
        windows: Sequence[int | None] = (None,),
        buffer: torch.Tensor | None = None,
    ) -> None:
        """layer_groups[g]: the model-wide KV layer indices pools[g] holds, in its order; windows[g]:
        its window; buffer: the 1-D tensor all pools lie in, back to back (several groups)."""
        if len(pools) != len(layer_groups) or len(pools) != len(windows) or not pools:
            raise ValueError(
                f"{len(pools)} pools for {len(layer_groups)} layer groups, {len(windows)} windows"
            )
        if len(pools) > 1 and buffer is None:
            raise ValueError("several KV groups' pools must lie in one buffer (one transfer region)")
        self.pools = list(pools)
        self.buffer = buffer
        unit = math.gcd(*(pool.page_bytes for pool in pools))
        offsets = [0]
        for pool in pools[:-1]:
            offsets.append(offsets[-1] + pool.num_blocks * pool.page_bytes // unit)
        self.unit_bytes = unit
        self.region_pages = RegionPages(
            pools[0].tokens_per_block,
            tuple(windows),
            tuple(pool.page_bytes // unit for pool in pools),
            tuple(offsets),
        )
        self.tokens_per_block = pools[0].tokens_per_block
        # layer -> (group, index within the group's pool)
        self._where = {
            layer: (group, local)
            for group, layers in enumerate(layer_groups)
            for local, layer in enumerate(layers)
        }

    @staticmethod
    def build(
        model_config: ModelConfig,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        extra_page_bytes: int = 0,
        chunk_tokens: int | None = None,
    ) -> PoolLayout:
        """The model's KV groups (make_kv_groups, honouring cache.sliding_window_kv), the memory
        budget split between them (group_cache_configs) and one pool per group. extra_page_bytes:
        stored next to each group-0 page (a hybrid's state snapshot) and counted in its size.
        chunk_tokens: the most prompt tokens one forward pass feeds (a sliding group's demand)."""
        groups = make_kv_groups(model_config.kv_layer_windows, cache.sliding_window_kv)
        page_bytes = [
            KVPool.page_bytes_for(model_config, cache.tokens_per_block, dtype, len(group.layer_indices))
            for group in groups
        ]
        page_bytes[0] += extra_page_bytes
        if cache.pool_split_tokens is None:
            # Every group as many blocks as the all-full pool: never fewer requests admitted than
            # that layout at any prompt length (docs/cache.md); --kv-split-tokens trades for length.
            configs = group_cache_configs(cache, groups, page_bytes, model_config.max_position_embeddings)
        else:
            configs = group_cache_configs(cache, groups, page_bytes, cache.pool_split_tokens, chunk_tokens)
        for config, page in zip(configs, page_bytes, strict=True):
            if config.num_blocks != cache.num_blocks and not cache.is_sized_by_memory:
                logger.info(
                    "KV pool: %d blocks of %.2f MiB fit in max_pool_bytes %d (asked for %d)",
                    config.num_blocks, page / 2**20, cache.max_pool_bytes, cache.num_blocks,
                )  # fmt: skip
        layers = [len(group.layer_indices) for group in groups]
        buffer = None
        storages: list[torch.Tensor | None] = [None] * len(groups)
        if len(groups) > 1:
            # One buffer, one transfer region: group g's pages after group g-1's.
            sizes = [
                config.num_blocks
                * KVPool.page_bytes_for(model_config, cache.tokens_per_block, dtype, num)
                // torch.empty((), dtype=dtype).element_size()
                for config, num in zip(configs, layers, strict=True)
            ]
            buffer = torch.zeros(sum(sizes), dtype=dtype, device=device)
            storages = list(torch.split(buffer, sizes))
        pools = [
            KVPool(model_config, config, dtype, device, num, storage)
            for config, num, storage in zip(configs, layers, storages, strict=True)
        ]
        pool = GroupedKVPool(
            pools, [group.layer_indices for group in groups], [group.window for group in groups], buffer
        )
        return PoolLayout(groups, tuple(configs), tuple(page_bytes), pool)

    @property
    def dtype(self) -> torch.dtype:
        return self.pools[0].dtype

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def group_of_layer(self, layer: int) -> int:
        return self._where[layer][0]

    def layer_view(self, layer: int) -> torch.Tensor:
        """[N_g, 2, T, H, D] of the layer's group."""
        group, local = self._where[layer]
        return self.pools[group].layer_view(local)

    def copy_blocks(self, copies: Sequence[Sequence[CopyOp]]) -> None:
        """copies[g]: group g's copies."""
        for pool, group_copies in zip(self.pools, copies, strict=True):
            pool.copy_blocks(group_copies)

    @property
    def data(self) -> torch.Tensor:
        """Group 0's tensor (the whole pool of a one-group cache)."""
        return self.pools[0].data

    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def page_bytes(self) -> int:
        return self.pools[0].page_bytes

    def region(self) -> KVRegion:
        """The transfer region: one group's pool as it always was, or the buffer of every group's
        pools with pages of unit_bytes (engine/region_pages.py)."""
        if self.buffer is None:
            return self.pools[0].region()
        return KVRegion(
            address=int(self.buffer.data_ptr()),
            page_bytes=self.unit_bytes,
            num_pages=self.buffer.numel() * self.buffer.element_size() // self.unit_bytes,
            device=str(self.device),
        )
