"""engine: the model, the paged KV cache, beam search and the continuous batch, as a library.

No gRPC, no UCX, no other project package. The public API is described in docs/interfaces.md.
"""

from __future__ import annotations

from engine.block_allocator import OutOfBlocksError, PoolTooSmallError
from engine.config import CacheConfig, EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from engine.types import Beam, KVRegion, PrefillResult, PromptReservation, RequestOutput

__all__ = [
    "Beam",
    "CacheConfig",
    "EngineConfig",
    "KVRegion",
    "LLMEngine",
    "OutOfBlocksError",
    "PoolTooSmallError",
    "PrefillResult",
    "PromptReservation",
    "RequestOutput",
    "SamplingParams",
]
