"""The engine's compiled kernels: engine/native/kernels.cpp, built once per machine, loaded as torch ops.

Why: a decode step's attention as eager torch ops is about 80 ops a layer (gathers, batched
matmuls over fixed items, a tree over items); for the 135M model that was 11 ms of a 51 ms lone
float32 step and a third of a 16-request one (issue 29). One compiled call a layer does the same
work with a fixed summation order per (token, kv head). RMSNorm, 6 ops a call (61 calls a step),
is one call too, float32 and bfloat16 (float64 keeps torch's ops: its parity with transformers);
so are a fused projection's rotary and K/V write (`rotary_write`, about 12 ops a layer, the same
bits as the torch ops).

How: the source is compiled with the host's C++ compiler against the installed torch's headers
(about 7 s) into a cache folder keyed by the source, torch's version, the compiler and the CPU's
flags (`-march=native`), then loaded with `torch.ops.load_library`. Concurrent processes build
into temporary files and rename, so they never load a half-written library. Where no compiler is
found or the build fails, `decode_kernel()` and `norm_kernel()` return None with the reason logged
once, and the engine keeps the torch forms (engine/invariant_decode.py, norms.RMSNorm).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "kernels.cpp"
# Who owns a build: BEAMSPLIT_KERNEL_CACHE, else $XDG_CACHE_HOME/beamsplit/kernels, else ~/.cache/...
CACHE_ENV = "BEAMSPLIT_KERNEL_CACHE"
BUILD_TIMEOUT_S = 300


def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "beamsplit" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compile_command(compiler: str, source: Path, target: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, "-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w",
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", str(source), "-o", str(target),
        f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
    ]  # fmt: skip


def _build(source: Path) -> Path:
    """The compiled library of `source`, built into the cache if it is not there yet."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256()
    for part in (source.read_bytes(), torch.__version__.encode(), version.encode(), _cpu_flags().encode()):
        key.update(part)
    folder = _cache_root() / key.hexdigest()[:24]
    target = folder / f"{source.stem}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("building the native kernels into %s (once per machine, about 7 s)", folder)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as partial:
        partial_path = Path(partial.name)
    try:
        result = subprocess.run(
            _compile_command(compiler, source, partial_path),
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            tail = result.stderr.strip().splitlines()[-5:]
            raise RuntimeError(f"{compiler} exited {result.returncode}: " + " | ".join(tail))
        os.replace(partial_path, target)
    finally:
        partial_path.unlink(missing_ok=True)
    return target


@functools.cache
def _loaded() -> bool:
    """Builds (if needed) and loads the library once; False, with the reason logged, where it cannot."""
    if hasattr(torch.ops.beamsplit, "decode_attention"):
        return True
    try:
        torch.ops.load_library(str(_build(SOURCE)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("native kernels unavailable, the engine runs torch ops (slower): %s", error)
        print(f"beamsplit: native kernels unavailable ({error}); using torch ops", file=sys.stderr)
        return False
    return True


def decode_kernel() -> Callable[..., Any] | None:
    """torch.ops.beamsplit.decode_attention, or None where the library cannot be built."""
    kernel: Callable[..., Any] | None = torch.ops.beamsplit.decode_attention if _loaded() else None
    return kernel


def rotary_kernel() -> Callable[..., Any] | None:
    """torch.ops.beamsplit.rotary_write (qkv, num_heads, cos, signed sin, kv_layer, slot blocks,
    slot offsets), or None where the library cannot be built."""
    kernel: Callable[..., Any] | None = torch.ops.beamsplit.rotary_write if _loaded() else None
    return kernel


def norm_kernel() -> Callable[..., Any] | None:
    """torch.ops.beamsplit.rms_norm (input, weight, eps), or None where the library cannot be built."""
    kernel: Callable[..., Any] | None = torch.ops.beamsplit.rms_norm if _loaded() else None
    return kernel


def add_norm_kernel() -> Callable[..., Any] | None:
    """torch.ops.beamsplit.add_rms_norm (residual, delta, weight, eps) -> (sum, norm of sum), or None
    where the library cannot be built."""
    kernel: Callable[..., Any] | None = torch.ops.beamsplit.add_rms_norm if _loaded() else None
    return kernel


def silu_mul_kernel() -> Callable[..., Any] | None:
    """torch.ops.beamsplit.silu_mul (gate_up, width) -> silu(gate) * up, or None where the library
    cannot be built."""
    kernel: Callable[..., Any] | None = torch.ops.beamsplit.silu_mul if _loaded() else None
    return kernel


def panel_linear_kernel() -> Callable[..., Any] | None:
    """torch.ops.beamsplit.panel_linear (rows [M, in] float32, panels [ceil(out / 16), in, 16],
    out) -> [M, out], or None where the library cannot be built."""
    kernel: Callable[..., Any] | None = torch.ops.beamsplit.panel_linear if _loaded() else None
    return kernel
