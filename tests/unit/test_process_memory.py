"""What a loaded engine keeps resident besides its tensors (issue 29, resident memory): no
mapping of the checkpoint file once its tensors are read (engine/models/loader.py), and the
heap's freed pages handed back after load (engine/heap.py). Both are checked through the
process's own mappings and resident set, not by timing."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest
import torch

from engine.heap import trim_heap
from engine.models.loader import load_model
from tests.helpers.checkpoints import write_random_llama_checkpoint


def mapped_paths() -> set[str]:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        return {line.split(maxsplit=5)[5].strip() for line in maps if len(line.split(maxsplit=5)) == 6}


def anonymous_rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_model_keeps_no_mapping_of_the_checkpoint_file(tmp_path: Path, dtype: str) -> None:
    """safetensors maps the file; a tensor left on that mapping (float32, where no cast copies
    it) kept the whole file resident beside the packed weights."""
    write_random_llama_checkpoint(tmp_path)
    (checkpoint,) = tmp_path.glob("*.safetensors")
    model, _, _ = load_model(tmp_path, dtype)
    assert str(checkpoint.resolve()) not in mapped_paths()
    assert all(parameter.dtype == getattr(torch, dtype) for parameter in model.parameters())


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to trim")
def test_trim_heap_hands_back_freed_pages_between_live_blocks() -> None:
    """Blocks freed between blocks still in use sit below the heap's top, where malloc never
    trims on its own; trim_heap must return them (32 MiB of the 64 freed at least)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    block_bytes = 64 * 1024  # under malloc's mmap threshold: from the heap
    blocks = []
    for _ in range(2048):
        block = libc.malloc(block_bytes)
        libc.memset(block, 1, block_bytes)  # resident
        blocks.append(block)
    for block in blocks[0::2]:  # every other block: each freed one lies between two live ones
        libc.free(block)
    before = anonymous_rss_bytes()
    assert trim_heap()
    released = before - anonymous_rss_bytes()
    for block in blocks[1::2]:
        libc.free(block)
    assert released >= 32 * 2**20, released
