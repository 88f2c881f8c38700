"""What the engine refuses before a request touches the cache: each error names the field."""

from __future__ import annotations

from engine.block_allocator import PoolTooSmallError
from engine.config import EngineConfig, SamplingParams, check_engine_params
from engine.models.config import ModelConfig


def check_prompt(model_config: ModelConfig, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    vocab_size = model_config.vocab_size
    bad_ids = [token_id for token_id in prompt_ids if not 0 <= token_id < vocab_size]
    if bad_ids:
        raise ValueError(f"prompt_ids must be in [0, vocab_size={vocab_size}), got {bad_ids[:5]}")
    limit = model_config.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"prompt_ids ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceed the model's "
            f"max_position_embeddings {limit}"
        )


def check_params(config: EngineConfig, model_config: ModelConfig, params: SamplingParams) -> None:
    check_engine_params(config, params)
    vocab_size = model_config.vocab_size
    if params.eos_token_id is not None and params.eos_token_id >= vocab_size:
        raise ValueError(f"eos_token_id must be < vocab_size {vocab_size}, got {params.eos_token_id}")


def check_fits_pool(request_id: str, needed: str, num_blocks: int, pool_blocks: int) -> None:
    """PoolTooSmallError when `num_blocks` (described by `needed`) exceed the whole pool."""
    if num_blocks > pool_blocks:
        raise PoolTooSmallError(
            f"request {request_id!r} needs {needed}, more than the pool's {pool_blocks} in all"
        )
