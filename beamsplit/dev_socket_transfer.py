"""TEMPORARY stand-in for transfer.UcxTransferAgent while transfer/ is being written: same
interface, pages sent over a plain TCP socket. Selected only by BEAMSPLIT_DEV_TRANSFER=socket.
To be deleted once UCX lands.
"""

from __future__ import annotations

import ctypes
import json
import secrets
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class _Offer:
    region: str
    page_ids: list[int]
    secret: str
    expires_at: float
    on_done: Callable[[str, Any], None] | None


class DevPullHandle:
    def __init__(self, transfer_id: str, status_enum: Any) -> None:
        self.transfer_id = transfer_id
        self._enum = status_enum
        self.status = status_enum.PENDING
        self.error: str | None = None
        self.bytes_moved = 0
        self.num_messages = 0
        self._done = threading.Event()

    def finish(self, status: Any, error: str | None = None) -> None:
        self.status, self.error = status, error
        self._done.set()

    def wait(self, timeout_s: float) -> Any:
        self._done.wait(timeout_s)
        return self.status

    def cancel(self) -> None:
        if not self._done.is_set():
            self.finish(self._enum.CANCELLED, "cancelled")


class DevSocketTransferAgent:
    def __init__(self, host: str, status_enum: Any, offer_type: Any) -> None:
        self._enum = status_enum
        self._offer_type = offer_type
        self._regions: dict[str, Any] = {}
        self._offers: dict[str, _Offer] = {}
        self._lock = threading.Lock()
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._expire, daemon=True).start()

    def register(self, name: str, region: Any) -> None:
        self._regions[name] = region

    def offer(self, region: str, page_ids: list[int], ttl_s: float, on_done: Any = None) -> Any:
        transfer_id = uuid.uuid4().hex
        secret = secrets.token_hex(8)
        expires_at = time.monotonic() + ttl_s
        with self._lock:
            self._offers[transfer_id] = _Offer(region, list(page_ids), secret, expires_at, on_done)
        return self._offer_type(transfer_id=transfer_id, secret=secret, address=self.address, expires_at=expires_at)

    def extend(self, transfer_id: str, ttl_s: float) -> bool:
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None:
                return False
            offer.expires_at = time.monotonic() + ttl_s
            return True

    def revoke(self, transfer_id: str) -> None:
        self._end(transfer_id, self._enum.CANCELLED)

    def _end(self, transfer_id: str, status: Any) -> None:
        with self._lock:
            offer = self._offers.pop(transfer_id, None)
        if offer is not None and offer.on_done is not None:
            offer.on_done(transfer_id, status)

    def _expire(self) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            with self._lock:
                lapsed = [tid for tid, offer in self._offers.items() if offer.expires_at < now]
            for transfer_id in lapsed:
                self._end(transfer_id, self._enum.TIMED_OUT)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            request = json.loads(_recv_frame(connection))
            with self._lock:
                offer = self._offers.get(request["transfer_id"])
            if offer is None or offer.secret != request["secret"] or not set(request["pages"]) <= set(offer.page_ids):
                connection.sendall(struct.pack("!q", -1))
                return
            region = self._regions[offer.region]
            payload = b"".join(
                ctypes.string_at(region.address + page * region.page_bytes, region.page_bytes)
                for page in request["pages"]
            )
            connection.sendall(struct.pack("!q", len(payload)) + payload)
            _recv_exact(connection, 1)
        self._end(request["transfer_id"], self._enum.DONE)

    def pull(self, peer_address: str, transfer_id: str, secret: str, src_region: str, src_page_ids: list[int],
             dst_region: str, dst_page_ids: list[int], timeout_s: float, checksum: bool = False) -> DevPullHandle:  # fmt: skip
        handle = DevPullHandle(transfer_id, self._enum)

        def run() -> None:
            try:
                host, port = peer_address.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=timeout_s) as connection:
                    request = {"transfer_id": transfer_id, "secret": secret, "pages": src_page_ids}
                    data = json.dumps(request).encode()
                    connection.sendall(struct.pack("!q", len(data)) + data)
                    (length,) = struct.unpack("!q", _recv_exact(connection, 8))
                    if length < 0:
                        handle.finish(self._enum.FAILED, "refused by holder")
                        return
                    payload = _recv_exact(connection, length)
                    region = self._regions[dst_region]
                    for index, page in enumerate(dst_page_ids):
                        chunk = payload[index * region.page_bytes : (index + 1) * region.page_bytes]
                        ctypes.memmove(region.address + page * region.page_bytes, chunk, region.page_bytes)
                    connection.sendall(b"k")
                    handle.bytes_moved = length
                    handle.num_messages = 1
                    handle.finish(self._enum.DONE)
            except Exception as error:
                handle.finish(self._enum.FAILED, str(error))

        threading.Thread(target=run, daemon=True).start()
        return handle

    def close(self) -> None:
        self._closed.set()
        self._server.close()


def _recv_exact(connection: socket.socket, length: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < length:
        chunk = connection.recv(length - len(chunks))
        if not chunk:
            raise ConnectionError("peer closed")
        chunks.extend(chunk)
    return bytes(chunks)


def _recv_frame(connection: socket.socket) -> bytes:
    (length,) = struct.unpack("!q", _recv_exact(connection, 8))
    return _recv_exact(connection, length)
