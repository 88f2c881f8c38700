"""The physical KV cache: one tensor, one block per page.

Dimensions: N blocks (pages), L layers with K/V (a hybrid's attention layers only), 2 (key, value), T tokens per block, H kv heads, D head dim.

    data [N, L, 2, T, H, D], contiguous

Block b is the byte range [b * page_bytes, (b + 1) * page_bytes) from `data_ptr()`: a page holds
every layer's keys and values for T tokens, and adjacent block ids are adjacent in memory, so a
run of adjacent pages moves as one message. The allocator decides which ids are used; this class
only stores and copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import CacheConfig
from engine.kv_cache import CopyOp
from engine.models.config import ModelConfig
from engine.types import KVRegion

KEY = 0
VALUE = 1


class KVPool:
    @staticmethod
    def page_bytes_for(model_config: ModelConfig, tokens_per_block: int, dtype: torch.dtype) -> int:
        """Bytes of one page (one block of every layer's keys and values) before any pool exists."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return (
            model_config.num_kv_layers * 2 * tokens_per_block * model_config.num_key_value_heads
            * model_config.head_dim * element_bytes
        )  # fmt: skip

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.tokens_per_block = cache_config.tokens_per_block
        # Zeroed rather than empty: a page that is read before it is written (a bug) shows as
        # zeros, not as whatever the allocator left there, and tests stay deterministic.
        self.data = torch.zeros(
            (
                cache_config.num_blocks,
                model_config.num_kv_layers,
                2,
                cache_config.tokens_per_block,
                model_config.num_key_value_heads,
                model_config.head_dim,
            ),
            dtype=dtype,
            device=device,
        )  # [N, L, 2, T, H, D]

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
