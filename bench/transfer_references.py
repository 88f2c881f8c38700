"""The references the transfer benchmark measures our pulls against (bench/transfer.py):
`ucx_perftest` (with the protocol UCX reports picking for it), NIXL's one-sided READ, and
`process_vm_readv` alone on the same pages (the kernel's limit for what a pull does)."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

# NIXL's UCX backend defaults to peer error handling, which on one host keeps UCX off cma (as for
# our agent, docs/transfer.md), and then needs a progress thread on the target, which spins. Without
# it, a READ is a cma zero-copy get that the target takes no part in.
NIXL_UCX_PARAMS = {"ucx_error_handling_mode": "none", "num_workers": "1"}


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _proto_size(text: str) -> float:
    if text == "inf":
        return float("inf")
    digits = text.rstrip("KMGT")
    return int(digits) * _SIZE_UNITS[text[len(digits) :]]


def tag_send_protocol(log: str, message_bytes: int) -> str | None:
    """From UCX_PROTO_INFO output: the protocol and transport of the first table of tagged sends
    from host memory to another process, for a message of this size ("rendezvous zero-copy read
    from remote over cma/memory"); None if there is no such table. Tables of endpoints to the
    process itself ("ucp_context_1 self cfg#0", the agent's receive lanes) are skipped."""
    in_table = False
    for line in log.splitlines():
        if "tagged message by ucp_tag_send* from host memory" in line:
            in_table = " self cfg#" not in line
            continue
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if not in_table or len(cells) != 3 or ".." not in cells[0]:
            continue
        low, high = cells[0].split("..")
        if _proto_size(low) <= message_bytes <= _proto_size(high):
            return f"{cells[1].removeprefix('(?) ')} over {cells[2]}"
    return None


def _perftest_command() -> tuple[str, dict[str, str]]:
    import libucx

    root = Path(libucx.__file__).resolve().parent
    environment = {**os.environ, "LD_LIBRARY_PATH": f"{root / 'lib'}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    environment["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return str(root / "bin" / "ucx_perftest"), environment


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def perftest_run(message_bytes: int, num_messages: int, proto_info: bool = False) -> tuple[float, str | None]:
    """ucx_perftest tag_bw: (GB/s, with `proto_info` the protocol UCX picked for its sends)."""
    binary, environment = _perftest_command()
    if proto_info:
        environment["UCX_PROTO_INFO"] = "y"
    port = _free_port()
    server = subprocess.Popen(
        [binary, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment
    )
    try:
        time.sleep(0.3)
        iterations = max(num_messages, 32)
        client = subprocess.run(
            [
                binary,
                "127.0.0.1",
                "-p",
                str(port),
                "-t",
                "tag_bw",
                "-s",
                str(message_bytes),
                "-n",
                str(iterations),
                "-w",
                "8",
            ],
            capture_output=True,
            text=True,
            env=environment,
            timeout=60,
        )
    finally:
        server.kill()
        server.wait(timeout=10)
    final = [line for line in client.stdout.splitlines() if line.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest gave no result: {client.stdout[-500:]} {client.stderr[-500:]}")
    megabytes_per_second = float(final[0].split()[6])  # overall bandwidth, MB = 2^20 bytes
    protocol = tag_send_protocol(client.stdout, message_bytes) if proto_info else None
    return megabytes_per_second * (1 << 20) / 1e9, protocol


class NixlReader:
    """NIXL, UCX backend: one READ request for all the pages, as serving systems use it."""

    def __init__(self, local_address: int, holder_info: dict[str, Any]) -> None:
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self._agent = nixl_agent("puller", nixl_agent_config(enable_prog_thread=False, backends=[]))
        self._agent.create_backend("UCX", NIXL_UCX_PARAMS)
        self._local_address = local_address
        self._remote_address = int(holder_info["pool_address"])
        self._remote_name = self._agent.add_remote_agent(bytes.fromhex(holder_info["nixl_metadata"]))

    def register(self, num_bytes: int) -> None:
        self._agent.register_memory([(self._local_address, num_bytes, 0, "")], "DRAM")

    def read_seconds(self, page_bytes: int, src_page_ids: list[int], dst_page_ids: list[int]) -> float:
        local = self._agent.get_xfer_descs(
            [(self._local_address + page * page_bytes, page_bytes, 0) for page in dst_page_ids], "DRAM"
        )
        remote = self._agent.get_xfer_descs(
            [(self._remote_address + page * page_bytes, page_bytes, 0) for page in src_page_ids], "DRAM"
        )
        start = time.perf_counter()
        handle = self._agent.initialize_xfer("READ", local, remote, self._remote_name)
        state = self._agent.transfer(handle)
        deadline = start + 60.0
        while state == "PROC" and time.perf_counter() < deadline:
            state = self._agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended {state}")
        return elapsed


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def cma_read_seconds(
    holder: Any, pool: np.ndarray, page_bytes: int, src: list[int], dst: list[int], num_threads: int
) -> float:
    """The same pages read with process_vm_readv alone, split over num_threads threads as the
    agent splits a pull over its lanes (ctypes releases the GIL during the call)."""
    libc = ctypes.CDLL(None, use_errno=True)
    read = libc.process_vm_readv
    read.restype = ctypes.c_ssize_t
    read.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    remote_base, local_base, pid = int(holder.info["pool_address"]), pool.ctypes.data, holder.process.pid
    errors: list[str] = []

    def copy(pairs: list[tuple[int, int]]) -> None:
        local, remote = _IoVec(0, page_bytes), _IoVec(0, page_bytes)
        for src_page, dst_page in pairs:
            local.base, remote.base = local_base + dst_page * page_bytes, remote_base + src_page * page_bytes
            if read(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != page_bytes:
                errors.append(os.strerror(ctypes.get_errno()))
                return

    pairs = list(zip(src, dst, strict=True))
    threads = [
        threading.Thread(target=copy, args=(pairs[index::num_threads],)) for index in range(num_threads)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"process_vm_readv failed: {errors[0]}")
    return elapsed
