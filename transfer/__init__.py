"""Moves registered byte ranges (KV pages) between processes over UCX; knows nothing of models.

`docs/transfer.md` describes the protocol, the rules and the benchmark.
"""

from __future__ import annotations

from transfer.agent import (
    AgentStats,
    MemoryRegion,
    Offer,
    PullHandle,
    TransferAgent,
    TransferError,
    TransferStatus,
)
from transfer.loopback import LoopbackHub, LoopbackTransferAgent
from transfer.ucx_agent import UcxTransferAgent

__all__ = [
    "AgentStats",
    "LoopbackHub",
    "LoopbackTransferAgent",
    "MemoryRegion",
    "Offer",
    "PullHandle",
    "TransferAgent",
    "TransferError",
    "TransferStatus",
    "UcxTransferAgent",
]
