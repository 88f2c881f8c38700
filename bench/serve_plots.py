"""The serving benchmark's two PNGs: a summary (throughput, latency percentiles, peak KV) and the
TTFT and inter-token latency distributions (CDFs) of the three systems."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SYSTEM_NAMES = ("disaggregated", "aggregated", "transformers")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_summary(systems: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    plt = _pyplot()
    names = [name for name in SYSTEM_NAMES if name in systems]
    figure, axes = plt.subplots(1, 4, figsize=(17, 4.2))

    def bars(ax: Any, key: str, label: str) -> None:
        values = [systems[name].get(key) or 0.0 for name in names]
        ax.bar(names, values, color=["C0", "C1", "C2"][: len(names)])
        for position, value in enumerate(values):
            ax.annotate(f"{value:.3g}", (position, value), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8)

    bars(axes[0], "beam_tokens_per_s", "generated beam tokens / s")
    axes[0].set_title("throughput (higher is better)")
    for ax, metric, label in ((axes[1], "ttft_ms", "TTFT ms"), (axes[2], "itl_ms", "inter-token latency ms")):
        width = 0.38
        for offset, quantile in ((-width / 2, "p50"), (width / 2, "p99")):
            values = [systems[name].get(f"{metric}_{quantile}") or 0.0 for name in names]
            ax.bar([index + offset for index in range(len(names))], values, width, label=quantile)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(f"{label.split(' ms')[0]} p50 / p99 (lower is better)")
    mib = [(systems[name].get("peak_kv_bytes") or 0) / 2**20 for name in names]
    axes[3].bar(names, mib, color=["C0", "C1", "C2"][: len(names)])
    axes[3].set_ylabel("peak KV MiB")
    axes[3].set_title("peak KV memory")
    axes[3].tick_params(axis="x", labelsize=8)
    figure.suptitle(title, fontsize=10)
    _save(figure, path)


def plot_cdfs(samples: dict[str, dict[str, Sequence[float]]], title: str, path: Path) -> None:
    """`samples`: system -> {"ttft_ms": [...], "itl_ms": [...]}."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, label in (
        (left, "ttft_ms", "time to first token, ms"),
        (right, "itl_ms", "inter-token latency, ms"),
    ):
        for name in SYSTEM_NAMES:
            values = sorted(samples.get(name, {}).get(key, []))
            if values:
                fractions = [(index + 1) / len(values) for index in range(len(values))]
                ax.step(values, fractions, where="post", label=f"{name} ({len(values)})")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples <= x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    _save(figure, path)


def _save(figure: Any, path: Path) -> None:
    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
