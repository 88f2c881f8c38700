"""KV benchmark: what a sliding-window model holds and ships, window-aware groups against all-full.

    beamsplit bench kv [--model gemma3-270m] [--json] [--quick]      (or: python bench/kv.py ...)

Two layouts of the same model, in the same run: `window` (the default: one KV group per attention
kind, a sliding group releasing blocks out of its window, docs/cache.md) and `all-full`
(`--no-sliding-window-kv`: one group, every block of every layer kept, as before issue 27).

- held: one engine per layout in this process (float32, block 32); each prompt (random token ids,
  a fresh one per case, so nothing is reused) runs alone with beam width W and a few new tokens,
  eos ignored. After every engine step the bytes the pool holds for it are read
  (blocks in use per group x that group's page bytes): `held_after_prefill` at the step that
  yields the first token, `peak` over the request. The beams of both layouts must be equal.
- moved: a context worker, a generation worker and a coordinator per layout (real processes, UCX
  on loopback); each prompt goes through the coordinator once per beam width (fresh prompts), and
  the coordinator's RequestStats give the bytes pulled. They must not depend on W.
- admitted: one engine per layout with the same byte budget; for each prompt length, requests of
  that length (beam width 4, max_new_tokens each, distinct random prompts) are queued, one more
  than the pool could ever hold, and ONE pass of the engine's scheduler admits what fits: the
  requests it runs at once. Measured, not computed; then every request is aborted.

Ratios are window / all-full, measured; `issue_bound` is the issue's expected ceiling for
Gemma 3 270M ((3 P + 15 (512 + 32)) / (18 P)), computed from the model's layers and window.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"
LAYOUTS = ("window", "all-full")
BLOCK_SIZE = 32
DTYPE = "float32"
QUICK_PROMPT_LENS = (64, 160)
QUICK_WINDOW = 16
QUICK_BLOCK_SIZE = 16
ADMITTED_BEAM_WIDTH = 4
QUICK_ADMITTED_BYTES = 256 * 6 * 2 * QUICK_BLOCK_SIZE * 16 * 4  # 256 all-full pages of the quick model
REQUEST_TIMEOUT_S = 900.0
STARTUP_TIMEOUT_S = 300.0


# ---- pure helpers (tests/unit/test_bench_kv.py) ----------------------------------------------
def issue_bound(prompt_len: int, layer_windows: Sequence[int | None], block_size: int) -> float:
    """Held bytes of the window layout over the all-full one when every sliding layer keeps its
    window plus one block: (full x P + sliding x min(P, window + T)) / (layers x P)."""
    full = sum(1 for window in layer_windows if window is None)
    sliding = sum(min(prompt_len, window + block_size) for window in layer_windows if window is not None)
    return (full * prompt_len + sliding) / (len(layer_windows) * prompt_len)


def ratio_rows(rows: Sequence[dict[str, Any]], key: str, group_by: Sequence[str]) -> list[dict[str, Any]]:
    """window / all-full of `key` for each group of rows that differ only in their layout."""
    by_case: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        by_case.setdefault(tuple(row[name] for name in group_by), {})[row["layout"]] = row[key]
    ratios = []
    for case, values in sorted(by_case.items()):
        if set(values) != set(LAYOUTS):
            raise ValueError(f"{key}: case {case} lacks a layout ({sorted(values)})")
        ratio = values["window"] / values["all-full"] if values["all-full"] else None
        ratios.append({**dict(zip(group_by, case, strict=True)), key: values, "ratio": ratio})
    return ratios


# ---- the run -----------------------------------------------------------------------------------
def _cpu_flags() -> list[str]:
    """/proc/cpuinfo's vector and matrix flags, as bench peers reports them (bench/peers_report.py);
    the held and moved bytes do not depend on them, the run's seconds do."""
    from beamsplit.cli.bench import load_bench_module

    cpuinfo = Path("/proc/cpuinfo")
    return list(load_bench_module("peers_report").cpu_flags(cpuinfo.read_text() if cpuinfo.exists() else ""))


def _say(message: str) -> None:
    print(f"[bench kv] {message}", file=sys.stderr, flush=True)


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab_size, 30000)) for _ in range(length)]


def write_quick_model(directory: Path) -> Path:
    """A random Gemma 3 of 6 layers (5 sliding : 1 full, as the real one) written by transformers."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        sliding_window=QUICK_WINDOW, query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=None,
        pad_token_id=0, layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    return directory


def _engine(model: str, block_size: int, pool_bytes: int, window_aware: bool, max_num_seqs: int = 64) -> Any:
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine

    cache = CacheConfig(
        tokens_per_block=block_size, max_pool_bytes=pool_bytes, is_sized_by_memory=True,
        sliding_window_kv=window_aware,
    )  # fmt: skip
    batched = max(EngineConfig.max_num_batched_tokens, max_num_seqs)
    return LLMEngine(
        EngineConfig(
            model=model, dtype=DTYPE, cache=cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=batched
        )
    )


def _held_bytes(engine: Any) -> int:
    """Pages in use (every group's, one shared pool) x the bytes of one page."""
    return int(engine.kv_cache.num_blocks_in_use() * engine.page_bytes)


def measure_admitted(
    model: str, prompt_lens: Sequence[int], max_new_tokens: int, block_size: int, pool_bytes: int
) -> list[dict[str, Any]]:
    """Per layout and prompt length, how many requests one pass of the scheduler admits at once."""
    from engine.config import SamplingParams

    rows: list[dict[str, Any]] = []
    params = SamplingParams(beam_width=ADMITTED_BEAM_WIDTH, max_new_tokens=max_new_tokens, ignore_eos=True)
    for layout in LAYOUTS:
        probe = _engine(model, block_size, pool_bytes, window_aware=layout == "window")
        num_pages, vocab_size = probe.kv_cache.num_blocks(), probe.model_config.vocab_size
        del probe
        for prompt_len in prompt_lens:
            # Every request holds its whole prompt in some group's pages: never more than this fit.
            num_queued = num_pages // -(-prompt_len // block_size) + 1
            engine = _engine(
                model, block_size, pool_bytes, layout == "window", ADMITTED_BEAM_WIDTH * num_queued
            )
            for index in range(num_queued):
                prompt = _prompt(7919 * index + prompt_len, prompt_len, vocab_size)
                engine.add_request(f"admit-{index}", prompt, params)
            engine.scheduler.schedule()  # admission: one pass of the real scheduler
            engine.check_integrity()
            admitted = len(engine.scheduler.running)
            rows.append({
                "layout": layout, "prompt_tokens": prompt_len, "beam_width": ADMITTED_BEAM_WIDTH,
                "max_new_tokens": max_new_tokens, "pool_pages": num_pages, "page_bytes": engine.page_bytes,
                "queued": num_queued, "admitted": admitted,
                "pages_in_use": engine.kv_cache.num_blocks_in_use(),
            })  # fmt: skip
            for index in range(num_queued):
                engine.abort(f"admit-{index}")
            engine.check_integrity()
            if engine.num_blocks_in_use():
                raise RuntimeError(f"admitted: {layout}, {prompt_len} tokens: blocks left after aborting")
            _say(
                f"admitted: {layout} P={prompt_len} W={ADMITTED_BEAM_WIDTH}: {admitted} of {num_queued} queued"
            )
            del engine
    return rows


def measure_held(
    model: str, prompt_lens: Sequence[int], beam_width: int, max_new_tokens: int, block_size: int,
    kv_cache_gib: float,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    from engine.config import SamplingParams

    rows: list[dict[str, Any]] = []
    beams: dict[tuple[str, int], list[list[int]]] = {}
    model_info: dict[str, Any] = {}
    for layout in LAYOUTS:
        started = time.monotonic()
        engine = _engine(model, block_size, int(kv_cache_gib * 2**30), window_aware=layout == "window")
        _say(f"held: {layout} engine ready in {time.monotonic() - started:.1f} s")
        config = engine.model_config
        model_info = {"kv_layer_windows": list(config.kv_layer_windows), "vocab_size": config.vocab_size}
        for prompt_len in prompt_lens:
            prompt = _prompt(prompt_len, prompt_len, config.vocab_size)
            params = SamplingParams(beam_width=beam_width, max_new_tokens=max_new_tokens, ignore_eos=True)
            request_id = f"{layout}-{prompt_len}"
            engine.add_request(request_id, prompt, params)
            started, after_prefill, peak, finished = time.monotonic(), None, 0, None
            while finished is None:
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    if output.error:
                        raise RuntimeError(f"{layout}, {prompt_len} tokens: {output.error}")
                    if after_prefill is None and (output.new_token_ids or output.finished):
                        after_prefill = _held_bytes(engine)
                    if output.finished:
                        finished = output
                peak = max(peak, _held_bytes(engine))
            engine.check_integrity()
            beams[(layout, prompt_len)] = [list(beam.token_ids) for beam in finished.beams]
            rows.append({
                "layout": layout, "prompt_tokens": prompt_len, "beam_width": beam_width,
                "held_after_prefill_bytes": after_prefill, "peak_held_bytes": peak,
                "held_after_finish_bytes": _held_bytes(engine), "seconds": round(time.monotonic() - started, 2),
            })  # fmt: skip
            _say(f"held: {layout} P={prompt_len}: {after_prefill} B after prefill, peak {peak} B")
        del engine
    model_info["beams_equal"] = all(beams[("window", n)] == beams[("all-full", n)] for n in prompt_lens)
    return rows, model_info


def measure_moved(
    model: str, prompt_lens: Sequence[int], beam_widths: Sequence[int], max_new_tokens: int,
    block_size: int, kv_cache_gib: float, vocab_size: int,
) -> list[dict[str, Any]]:  # fmt: skip
    from beamsplit.client.grpc_client import BeamsplitClient, build_request
    from beamsplit.launch.local_cluster import start_local_cluster
    from beamsplit.v1 import common_pb2

    rows: list[dict[str, Any]] = []
    for layout in LAYOUTS:
        arguments = ["--model", model, "--dtype", DTYPE, "--tokens-per-block", str(block_size)]
        if layout == "all-full":
            arguments.append("--no-sliding-window-kv")
        with tempfile.TemporaryDirectory(prefix="bench-kv-") as log_dir:
            _say(f"moved: starting the {layout} deployment (logs in {log_dir})")
            cluster = start_local_cluster(
                Path(log_dir), engine_arguments=arguments, progress=_say,
                startup_timeout_s=STARTUP_TIMEOUT_S, kv_cache_gib=kv_cache_gib,
                coordinator_arguments=(
                    "--wait-for-workers-s", str(STARTUP_TIMEOUT_S), "--prefill-timeout-s", str(REQUEST_TIMEOUT_S),
                ),
            )  # fmt: skip
            try:
                with BeamsplitClient(cluster.coordinator.address) as client:
                    for prompt_len in prompt_lens:
                        for beam_width in beam_widths:
                            prompt = _prompt(1000 * prompt_len + beam_width, prompt_len, vocab_size)
                            sampling = common_pb2.SamplingOptions(
                                beam_width=beam_width, max_new_tokens=max_new_tokens, ignore_eos=True
                            )
                            request = build_request(token_ids=prompt, sampling=sampling)
                            stats: dict[str, Any] = client.generate(
                                request, timeout_s=REQUEST_TIMEOUT_S
                            ).stats
                            rows.append({
                                "layout": layout, "prompt_tokens": prompt_len, "beam_width": beam_width,
                                "transferred_bytes": int(stats["transferred_bytes"]),
                                "transferred_blocks": int(stats["transferred_blocks"]),
                            })  # fmt: skip
                            _say(
                                f"moved: {layout} P={prompt_len} W={beam_width}: {rows[-1]['transferred_bytes']} B"
                            )
            finally:
                cluster.stop()
    return rows


def _plot(held: list[dict[str, Any]], moved: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, rows, key, title in (
        (axes[0], held, "held_after_prefill_bytes", "KV held after prefill and at peak (MiB)"),
        (axes[1], [row for row in moved if row["beam_width"] == max(r["beam_width"] for r in moved)],
         "transferred_bytes", "KV moved per request (MiB)"),
    ):  # fmt: skip
        for layout, marker in zip(LAYOUTS, "os", strict=True):
            mine = sorted(
                (row for row in rows if row["layout"] == layout), key=lambda row: row["prompt_tokens"]
            )
            lengths = [row["prompt_tokens"] for row in mine]
            axis.plot(lengths, [row[key] / 2**20 for row in mine], marker + "-", label=layout)
            if key == "held_after_prefill_bytes":  # the most held at any step of the request
                peaks = [row["peak_held_bytes"] / 2**20 for row in mine]
                axis.plot(lengths, peaks, marker + "--", label=f"{layout}, peak")
        axis.set_xlabel("prompt tokens")
        axis.set_title(title)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def run(arguments: argparse.Namespace) -> int:
    import os

    model, prompt_lens, block_size = arguments.model, list(arguments.prompt_lens), BLOCK_SIZE
    with tempfile.TemporaryDirectory(prefix="bench-kv-model-") as model_dir:
        if arguments.quick:
            model = str(write_quick_model(Path(model_dir)))
            prompt_lens, block_size = list(QUICK_PROMPT_LENS), QUICK_BLOCK_SIZE
        widths = sorted(set(arguments.beam_widths))
        admitted_bytes = QUICK_ADMITTED_BYTES if arguments.quick else int(arguments.kv_cache_gib * 2**30)
        admitted = measure_admitted(model, prompt_lens, arguments.max_new_tokens, block_size, admitted_bytes)
        held: list[dict[str, Any]] = []
        info: dict[str, Any] = {"kv_layer_windows": None, "beams_equal": None}
        if not arguments.admitted_only:
            held, info = measure_held(
                model, prompt_lens, max(widths), arguments.max_new_tokens, block_size, arguments.kv_cache_gib
            )
        moved: list[dict[str, Any]] = []
        if not arguments.skip_moved and not arguments.admitted_only:
            moved = measure_moved(
                model, prompt_lens, widths, arguments.max_new_tokens, block_size, arguments.kv_cache_gib,
                info["vocab_size"],
            )  # fmt: skip
    windows = info["kv_layer_windows"]
    admitted_ratios = ratio_rows(admitted, "admitted", ["prompt_tokens"])
    held_ratios = ratio_rows(held, "held_after_prefill_bytes", ["prompt_tokens"]) if held else []
    for row in held_ratios:
        row["issue_bound"] = round(issue_bound(row["prompt_tokens"], windows, block_size), 4)
        row["within_bound"] = row["ratio"] is not None and row["ratio"] <= row["issue_bound"]
    peak_ratios = ratio_rows(held, "peak_held_bytes", ["prompt_tokens"]) if held else []
    moved_ratios = ratio_rows(moved, "transferred_bytes", ["prompt_tokens", "beam_width"]) if moved else []
    independent_of_width = all(
        len({row["transferred_bytes"] for row in moved if (row["layout"], row["prompt_tokens"]) == case}) == 1
        for case in {(row["layout"], row["prompt_tokens"]) for row in moved}
    )
    result = {
        "benchmark": "kv", "model": arguments.model if not arguments.quick else "quick-gemma3",
        "dtype": DTYPE, "tokens_per_block": block_size, "kv_layer_windows": windows,
        "cpu_flags": _cpu_flags(), "threads": os.cpu_count(),
        "held": held, "held_ratios": held_ratios, "peak_ratios": peak_ratios, "moved": moved, "moved_ratios": moved_ratios,
        "admitted_pool_bytes": admitted_bytes, "admitted": admitted, "admitted_ratios": admitted_ratios,
        "goals": {
            "beams_equal_between_layouts": info["beams_equal"],
            "held_within_issue_bound": all(row["within_bound"] for row in held_ratios) if held else None,
            "window_admits_at_least_all_full": all(
                row["admitted"]["window"] >= row["admitted"]["all-full"] for row in admitted_ratios
            ),
            "moved_independent_of_beam_width": independent_of_width if moved else None,
            "moved_shrinks_like_held": all(
                row["ratio"] is not None and row["ratio"] <= held_row["issue_bound"]
                for row in moved_ratios for held_row in held_ratios
                if held_row["prompt_tokens"] == row["prompt_tokens"]
            ) if moved else None,
        },
    }  # fmt: skip
    arguments.out_dir.mkdir(parents=True, exist_ok=True)
    (arguments.out_dir / "kv.json").write_text(json.dumps(result, indent=2) + "\n")
    if moved:
        _plot(held, moved, arguments.out_dir / "kv.png")
    if arguments.json:
        print(json.dumps(result, indent=2))
    else:
        for row in admitted_ratios:
            print(
                f"P={row['prompt_tokens']} W={ADMITTED_BEAM_WIDTH}: admitted at once window "
                f"{row['admitted']['window']}, all-full {row['admitted']['all-full']}"
            )
        for row, peak in zip(held_ratios, peak_ratios, strict=True):
            print(
                f"P={row['prompt_tokens']}: held window/all-full {row['ratio']:.3f} (bound {row['issue_bound']}),"
                f" peak {peak['ratio']:.3f}"
            )
        for row in moved_ratios:
            print(f"P={row['prompt_tokens']} W={row['beam_width']}: moved window/all-full {row['ratio']:.3f}")
    return 0 if all(value is not False for value in result["goals"].values()) else 1


if __name__ == "__main__":
    from beamsplit.cli.bench import add_kv_arguments

    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _parser.add_argument("--json", action="store_true", help="print only the JSON on stdout")
    add_kv_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
