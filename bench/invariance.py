"""What batch invariance costs: the engine with and without `batch_invariant`, side by side.

In process, on bench serve's 156M random Llama (float32), alternating the two settings so both
see the same machine load; each case reports the best of `--repeats` runs:
- prefill: one prompt of 512 and one of 2048 tokens (ms per prompt);
- decode: ms per engine step for 1 greedy request, 1 beam-4 request, and 8 beam-4 requests
  (prompts of 256 tokens, 32 steps).
Prints JSON (ratio = invariant / padded; above 1 means invariance costs) and draws a PNG.
`--quick` uses the small preset and fewer cases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from beamsplit.cli.bench import load_bench_module


def _say(message: str) -> None:
    print(f"[invariance] {message}", file=sys.stderr, flush=True)


def _engine(model_dir: Path, batch_invariant: bool) -> Any:
    from engine import CacheConfig, EngineConfig, LLMEngine

    cache = CacheConfig(tokens_per_block=32, num_blocks=1024)
    return LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", cache=cache, batch_invariant=batch_invariant)
    )


def _prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % (vocab_size - 10) + 5 for index in range(length)]


def _prefill_ms(engine: Any, length: int, seed: int) -> float:
    started = time.perf_counter()
    engine.prefill(f"p{seed}", _prompt(length, seed, engine.model_config.vocab_size), 1)
    elapsed = time.perf_counter() - started
    engine.release_prefill(f"p{seed}")
    return elapsed * 1000.0


def _decode_step_ms(engine: Any, num_requests: int, beam_width: int, steps: int, seed: int) -> float:
    from engine import SamplingParams

    params = SamplingParams(beam_width=beam_width, max_new_tokens=steps, ignore_eos=True)
    for index in range(num_requests):
        engine.add_request(
            f"d{seed}-{index}", _prompt(256, seed * 100 + index, engine.model_config.vocab_size), params
        )
    engine.step()  # the prefills
    started, count = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        count += 1
    return (time.perf_counter() - started) * 1000.0 / max(count, 1)


def run(arguments: argparse.Namespace) -> int:
    serve_model = load_bench_module("serve_model")
    preset = serve_model.PRESETS["llama-small" if arguments.quick else "llama-156m"]
    model_dir = serve_model.ensure_checkpoint(preset)
    repeats = 1 if arguments.quick else arguments.repeats
    prefill_lengths = (128,) if arguments.quick else (512, 2048)
    decode_cases = ((1, 1), (2, 4)) if arguments.quick else ((1, 1), (1, 4), (8, 4))
    steps = 8 if arguments.quick else 32
    engines = {setting: _engine(model_dir, setting) for setting in (False, True)}
    results: dict[str, dict[bool, list[float]]] = {}
    seed = 0
    for repeat in range(repeats):
        for setting in (False, True) if repeat % 2 == 0 else (True, False):
            engine = engines[setting]
            for length in prefill_lengths:
                seed += 1
                results.setdefault(f"prefill_{length}_ms", {}).setdefault(setting, []).append(
                    _prefill_ms(engine, length, seed)
                )
            for num_requests, beam_width in decode_cases:
                seed += 1
                results.setdefault(f"decode_step_{num_requests}x_beam{beam_width}_ms", {}).setdefault(
                    setting, []
                ).append(_decode_step_ms(engine, num_requests, beam_width, steps, seed))
            _say(f"repeat {repeat + 1}/{repeats}, batch_invariant={setting}: done")
    cases = {
        name: {
            "padded": round(min(by_setting[False]), 3),
            "invariant": round(min(by_setting[True]), 3),
            "ratio": round(min(by_setting[True]) / min(by_setting[False]), 3),
        }
        for name, by_setting in results.items()
    }
    report = {
        "benchmark": "invariance",
        "model": preset.name,
        "dtype": "float32",
        "repeats": repeats,
        "statistic": "best of repeats, the two settings alternated",
        "cases": cases,
    }
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    report["plot"] = str(_plot(cases, out_dir / "invariance.png"))
    print(json.dumps(report, indent=None if arguments.json else 1))
    return 0


def _plot(cases: dict[str, dict[str, float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    names = list(cases)
    axis.barh(names, [cases[name]["ratio"] for name in names])
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.set_xlabel("time with batch_invariant / without (lower is better)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON on stdout")
    parser.add_argument("--quick", action="store_true", help="small model, one repeat")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (default: 3)")


if __name__ == "__main__":
    command_line = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(command_line)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(run(command_line.parse_args()))
