"""A process that dies in the middle of writing a message to a UCX worker, for the transfer tests.

    python -m tests.fifo_saboteur WORKER_ADDRESS_HEX

It opens an endpoint to the worker (with the agent's own UCX settings), sends one good 64-byte
message and waits for it, prints {"sent": true}, then sends 64 bytes from a buffer it has made
unreadable (mprotect PROT_NONE). Over a shared-memory FIFO transport (posix, sysv) UCX claims a
slot in the receiver's FIFO before it copies the payload, so the copy faults and this process
dies by SIGSEGV with the slot claimed and never marked ready: what a peer SIGKILLed at that
instant leaves. Over tcp the kernel copies the payload and the send fails (EFAULT) instead, and
the process kills itself (SIGKILL) to end the same way: a peer gone mid-message.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import sys
import time

import numpy as np

from transfer.ucx_binding import load_binding

_PROT_NONE = 0
_WAIT_S = 5.0


def _wait(binding: object, request: object) -> tuple[bool, str | None]:
    deadline = time.monotonic() + _WAIT_S
    while True:
        binding.progress()  # type: ignore[attr-defined]
        state = binding.request_state(request)  # type: ignore[attr-defined]
        if state[0] or time.monotonic() > deadline:
            return state  # type: ignore[no-any-return]


def main(worker_address_hex: str) -> None:
    binding = load_binding(net_devices="lo")
    endpoint = binding.connect(bytes.fromhex(worker_address_hex))
    good = np.arange(64, dtype=np.uint8)
    completed, error = _wait(binding, binding.send(endpoint, good, 1))
    print(json.dumps({"sent": completed and error is None, "error": error}), flush=True)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    unreadable = np.frombuffer(page, dtype=np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(ctypes.c_void_p(unreadable.ctypes.data), mmap.PAGESIZE, _PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    _wait(binding, binding.send(endpoint, unreadable[:64], 2))  # SIGSEGV here over posix/sysv
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
