"""`bench peers`' numbers: the host's limits, each system's figures and ratios, the goals, the plot.

Pure Python on the report's plain numbers, except `measure_host_limits` (torch, in the bench's
own process, before any system runs). Loaded by bench/peers.py as a sibling module.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
PEERS = ("transformers", "openvino", "ctranslate2")
OURS = ("beamsplit-aggregated", "beamsplit-disaggregated")


def cpu_flags(cpuinfo: str) -> list[str]:
    """The REPORTED_FLAGS found in /proc/cpuinfo's first `flags` line."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            found = set(line.split(":", 1)[1].split())
            return [flag for flag in REPORTED_FLAGS if flag in found]
    return []


def precisions(flags: list[str]) -> tuple[list[str], str]:
    """float32 always; bfloat16 where the CPU has native bf16 (else why not)."""
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if native:
        return ["float32", "bfloat16"], f"native bf16: {', '.join(native)}"
    return ["float32"], f"bfloat16 skipped: none of {', '.join(NATIVE_BF16_FLAGS)} in /proc/cpuinfo"


def measure_host_limits(precision_names: list[str], threads: int, quick: bool) -> dict[str, Any]:
    """A large GEMM's FLOP/s per precision and the host's copy bandwidth (bytes/s, read + write),
    medians of 3, at the systems' thread count."""
    import torch

    torch.set_num_threads(threads)
    size = 512 if quick else 2048
    limits: dict[str, Any] = {"gemm_size": size, "gemm_flops_per_s": {}}
    for name in precision_names:
        dtype = getattr(torch, name)
        left, right = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        left @ right
        times = []
        for _ in range(3):
            started = time.perf_counter()
            left @ right
            times.append(time.perf_counter() - started)
        limits["gemm_flops_per_s"][name] = 2 * size**3 / statistics.median(times)
    num_bytes = (32 if quick else 512) * 2**20
    source, target = torch.empty(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    source.fill_(1)
    target.copy_(source)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    limits["copy_bytes_per_s"] = 2 * num_bytes / statistics.median(times)
    return limits


def merge_rounds(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's raw timings from its rounds (bench/peers.py runs every system once a round, the
    rounds one after the other, so that a host's drift between minutes falls on every system alike):
    the lists of timings joined in round order, the batch's median over them, every other number's
    median but resident memory's maximum, the first round's top beams; the first failed round's
    error where one failed (named by its round where an earlier one did not fail)."""
    for index, raw in enumerate(raws):
        if "error" in raw:
            return raw if index == 0 else {**raw, "error": f"round {index + 1}: {raw['error']}"}
    merged: dict[str, Any] = {}
    for key, first in raws[0].items():
        values = [raw[key] for raw in raws if key in raw]
        if key == "batch_top_beams" or not isinstance(first, (int, float, list)) or isinstance(first, bool):
            merged[key] = first
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        elif "rss" in key:
            merged[key] = max(values)
        else:
            merged[key] = statistics.median(values)
    merged["batch_s"] = statistics.median(merged["batch_runs_s"])
    merged["first_runs_s"] = [raw["first_s"] for raw in raws]
    return merged


def system_figures(raw: dict[str, Any], num_requests: int, new_tokens: int, width: int) -> dict[str, Any]:
    """One run's figures from its raw timings: single-request latency (median), throughput in beam
    tokens/s (every request's W beams x new tokens over the batch's wall time), first-request
    ratio to the warm median."""
    figures = dict(raw)
    figures["single_request_s"] = statistics.median(raw["single_s"])
    figures["beam_tokens_per_s"] = num_requests * width * new_tokens / raw["batch_s"]
    figures["first_over_warm"] = raw["first_s"] / figures["single_request_s"]
    return figures


def host_fractions(
    figures: dict[str, Any], limits: dict[str, Any], precision: str, model: dict[str, Any]
) -> None:
    """How far prefill and decode are from the host's limits (in place): prefill FLOP/s (2 x
    linear parameters x prompt tokens / TTFT) over the GEMM's, and the weights' streaming time
    (bytes in this precision / copy bandwidth) over the decode step (the greedy ITL)."""
    gemm = limits["gemm_flops_per_s"].get(precision)
    if figures.get("ttft_s") and gemm:
        flops = 2 * model["linear_parameters"] * model["single_prompt_tokens"] / figures["ttft_s"]
        figures["prefill_flops_per_s"] = flops
        figures["prefill_fraction_of_gemm"] = flops / gemm
    if figures.get("itl_s"):
        weight_bytes = model["parameters"] * (2 if precision == "bfloat16" else 4)
        stream_s = weight_bytes / limits["copy_bytes_per_s"]
        figures["weights_stream_s"] = stream_s
        figures["decode_fraction_of_stream"] = stream_s / figures["itl_s"]


def agreement(top_beams: list[list[int]], reference: list[list[int]] | None) -> int | None:
    """Requests whose top beam equals transformers float32's."""
    if reference is None:
        return None
    return sum(mine == theirs for mine, theirs in zip(top_beams, reference, strict=True))


def goal(name: str, measured: float | None, bound: float, at_least: bool) -> dict[str, Any]:
    met = None if measured is None else (measured >= bound if at_least else measured <= bound)
    return {
        "goal": name,
        "measured": None if measured is None else round(measured, 3),
        "bound": bound,
        "direction": ">=" if at_least else "<=",
        "met": met,
    }


def build_goals(
    results: dict[str, dict[str, Any]], precision_names: list[str], native_bf16: bool
) -> list[dict[str, Any]]:
    """results[precision][system] -> figures. Ratios against the fastest peer that ran."""
    goals = []
    for precision in precision_names:
        systems = results.get(precision, {})
        peers = [figures for name, figures in systems.items() if name in PEERS and "error" not in figures]
        best_throughput = max((figures["beam_tokens_per_s"] for figures in peers), default=None)
        best_single = min((figures["single_request_s"] for figures in peers), default=None)
        for name in OURS:
            figures = systems.get(name)
            if figures is None or "error" in figures:
                continue
            throughput = figures["beam_tokens_per_s"] / best_throughput if best_throughput else None
            goals.append(goal(f"{name} {precision} throughput / fastest peer", throughput, 1.5, True))
            single = figures["single_request_s"] / best_single if best_single else None
            goals.append(goal(f"{name} {precision} single request / fastest peer", single, 1.0, False))
            goals.append(
                goal(f"{name} {precision} first request / warm", figures["first_over_warm"], 1.2, False)
            )
            memory = figures.get("rss_over_weights_and_pool")
            goals.append(goal(f"{name} {precision} RSS / (weights + KV pool)", memory, 1.3, False))
    if native_bf16 and "bfloat16" in results:
        for name in OURS:
            f32, bf16 = results["float32"].get(name), results["bfloat16"].get(name)
            if not f32 or not bf16 or "error" in f32 or "error" in bf16:
                continue
            goals.append(
                goal(
                    f"{name} bf16 throughput / f32",
                    bf16["beam_tokens_per_s"] / f32["beam_tokens_per_s"],
                    1.5,
                    True,
                )
            )
            goals.append(
                goal(
                    f"{name} f32 single / bf16 single",
                    f32["single_request_s"] / bf16["single_request_s"],
                    1.5,
                    True,
                )
            )
    return goals


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Each system's figures over the fastest peer's at its precision (in place)."""
    for systems in results.values():
        peers = [figures for name, figures in systems.items() if name in PEERS and "error" not in figures]
        best_throughput = max((figures["beam_tokens_per_s"] for figures in peers), default=None)
        best_single = min((figures["single_request_s"] for figures in peers), default=None)
        for figures in systems.values():
            if "error" in figures:
                continue
            if best_throughput:
                figures["throughput_over_fastest_peer"] = figures["beam_tokens_per_s"] / best_throughput
            if best_single:
                figures["single_over_fastest_peer"] = figures["single_request_s"] / best_single


def table(results: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of the headline figures."""
    lines = [
        "| precision | system | one request alone (s) | 16 at once (beam tokens/s) | vs fastest peer (single, thr.) "
        "| first/warm | RSS MiB | top beam = transformers f32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for precision, systems in results.items():
        for name, figures in systems.items():
            if "error" in figures:
                lines.append(f"| {precision} | {name} | skipped: {figures['error']} | | | | | |")
                continue
            single_ratio = figures.get("single_over_fastest_peer")
            throughput_ratio = figures.get("throughput_over_fastest_peer")
            ratios = f"{_fmt(single_ratio)}, {_fmt(throughput_ratio)}"
            lines.append(
                f"| {precision} | {name} | {figures['single_request_s']:.2f} | {figures['beam_tokens_per_s']:.1f} "
                f"| {ratios} | {figures['first_over_warm']:.2f} | {figures.get('rss_bytes', 0) / 2**20:.0f} "
                f"| {_fmt(figures.get('agreement'))}/{figures.get('num_requests', '?')} |"
            )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def plot(results: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Two bar charts (single-request latency, throughput) per precision; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        return None
    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4.5))
    for axis, key, title in (
        (axes[0], "single_request_s", "one request alone (s, lower is better)"),
        (axes[1], "beam_tokens_per_s", "16 requests at once (beam tokens/s)"),
    ):
        labels, values = [], []
        for precision, systems in results.items():
            for name, figures in systems.items():
                if "error" not in figures:
                    labels.append(f"{name}\n{precision}")
                    values.append(figures[key])
        axis.barh(labels, values)
        axis.set_title(title)
        axis.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
