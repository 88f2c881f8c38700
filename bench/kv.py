"""Sliding-window KV: what one request holds and ships, window-aware against the all-full layout.

In process, for each prompt length (1k, 4k, 8k tokens; --quick: 64, 1024), the same prompt is
prefilled once by an engine with the window-aware KV groups and once by one with
`sliding_window_kv=False` (every block of every layer), in the same run. Both are measured, not
computed:
- held: bytes of the KV blocks in use once the prompt is whole, summed over the KV groups
  (`EngineCounters.group_blocks_in_use` x each group's page bytes). The prompt is pinned as the
  context worker pins it; a generation worker's reservation holds the same blocks (both release
  by the prompt's end), which is also what its first decode step reads.
- moved: bytes a disaggregated request pulls without reuse: the context side's offer
  (`PrefillResult.region_page_ids`) times the transfer region's page bytes (`kv_region()`), the
  figure the generation worker reports as `transferred_bytes`. Independent of the beam width: the
  prompt is shipped once, before the beams expand.
Prints JSON (ratios = window-aware / all-full) and draws a PNG under bench/out/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

TOKENS_PER_BLOCK = 32


def _say(message: str) -> None:
    print(f"[kv] {message}", file=sys.stderr, flush=True)


def _engine(model: str, window_aware: bool, max_len: int) -> Any:
    from engine import CacheConfig, EngineConfig, LLMEngine

    num_blocks = max_len // TOKENS_PER_BLOCK + 4
    cache = CacheConfig(
        tokens_per_block=TOKENS_PER_BLOCK, num_blocks=num_blocks, sliding_window_kv=window_aware
    )
    return LLMEngine(EngineConfig(model=model, dtype="float32", cache=cache))


def _prompt(length: int, vocab_size: int) -> list[int]:
    return [(index * 104729 + 17) % (vocab_size - 10) + 5 for index in range(length)]


def _measure(engine: Any, prompt: list[int], request_id: str) -> dict[str, Any]:
    started = time.perf_counter()
    result = engine.prefill(request_id, prompt, 1)
    prefill_s = time.perf_counter() - started
    counters = engine.counters()
    page_bytes = [pool.page_bytes for pool in engine.kv_pool.pools]
    held = sum(count * size for count, size in zip(counters.group_blocks_in_use, page_bytes, strict=True))
    moved = len(result.region_page_ids) * engine.kv_region().page_bytes
    engine.check_integrity()
    engine.release_prefill(request_id)
    return {
        "held_bytes": held,
        "moved_bytes": moved,
        "blocks_in_use_per_group": dict(zip(counters.group_names, counters.group_blocks_in_use, strict=True)),
        "region_pages": len(result.region_page_ids),
        "prefill_s": round(prefill_s, 2),
    }


def run(arguments: argparse.Namespace) -> int:
    lengths = (64, 1024) if arguments.quick else (1024, 4096, 8192)
    if getattr(arguments, "lengths", None):
        lengths = tuple(int(length) for length in arguments.lengths.split(","))
    engines = {aware: _engine(arguments.model, aware, max(lengths)) for aware in (True, False)}
    config = engines[True].model_config
    groups = [(group.window, len(group.layer_indices)) for group in engines[True].kv_cache.groups]
    _say(f"{arguments.model}: KV groups (window, layers) {groups}, block {TOKENS_PER_BLOCK}")
    cases = {}
    for length in lengths:
        prompt = _prompt(length, config.vocab_size)
        window_aware = _measure(engines[True], prompt, f"aware-{length}")
        all_full = _measure(engines[False], prompt, f"full-{length}")
        cases[str(length)] = {
            "window_aware": window_aware,
            "all_full": all_full,
            "held_ratio": round(window_aware["held_bytes"] / all_full["held_bytes"], 4),
            "moved_ratio": round(window_aware["moved_bytes"] / all_full["moved_bytes"], 4),
        }
        _say(
            f"{length} tokens: held x{cases[str(length)]['held_ratio']}, moved x{cases[str(length)]['moved_ratio']}"
        )
    note = "; ".join(
        f"{length} tokens: held {case['held_ratio']:.2f}x, moved {case['moved_ratio']:.2f}x of the all-full layout"
        for length, case in cases.items()
    )
    report: dict[str, Any] = {
        "benchmark": "kv",
        "model": arguments.model,
        "dtype": "float32",
        "tokens_per_block": TOKENS_PER_BLOCK,
        "kv_groups": [{"window": window, "layers": layers} for window, layers in groups],
        "held": "EngineCounters.group_blocks_in_use x page bytes per group, prompt whole (pinned)",
        "moved": "PrefillResult.region_page_ids x kv_region().page_bytes (the offer; no reuse)",
        "cases": cases,
        "note": note,
    }
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    report["plot"] = str(_plot(cases, out_dir / "kv.png"))
    print(json.dumps(report, indent=None if arguments.json else 1))
    if not arguments.json:
        print(note, file=sys.stderr)
    return 0


def _plot(cases: dict[str, dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    lengths = list(cases)
    positions = range(len(lengths))
    axis.bar([p - 0.2 for p in positions], [cases[n]["held_ratio"] for n in lengths], 0.4, label="held")
    axis.bar([p + 0.2 for p in positions], [cases[n]["moved_ratio"] for n in lengths], 0.4, label="moved")
    axis.set_xticks(list(positions), [f"{n} tokens" for n in lengths])
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_ylabel("window-aware / all-full KV bytes (lower is better)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON on stdout")
    parser.add_argument("--quick", action="store_true", help="prompts of 64 and 1024 tokens")
    parser.add_argument(
        "--model", default="gemma3-270m", help="a model with sliding windows (default: gemma3-270m)"
    )


if __name__ == "__main__":
    command_line = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(command_line)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(run(command_line.parse_args()))
