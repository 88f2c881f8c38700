"""The generation worker's calls back to a context worker: Heartbeat while pulling, Release after.

Both are best effort with short bounds: the context worker's lease frees the pages anyway if a
call never arrives, so a slow or dead context worker cannot stall a generation request.
"""

from __future__ import annotations

import logging
import threading

import grpc

from beamsplit.server.server_common import peer_channel
from beamsplit.server.tls import TlsConfig
from beamsplit.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class ContextClient:
    def __init__(self, call_timeout_s: float = 2.0, tls: TlsConfig | None = None) -> None:
        self._call_timeout_s = call_timeout_s
        self._tls = tls  # a CA: TLS to context workers, our certificate shown (mutual TLS)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _stub(self, address: str) -> worker_pb2_grpc.ContextWorkerStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = peer_channel(address, self._tls)
                self._channels[address] = channel
        return worker_pb2_grpc.ContextWorkerStub(channel)

    def heartbeat(self, address: str, transfer_id: str, extend_s: float) -> bool:
        """True while the hold is alive (or the context worker could not be asked)."""
        if not address:
            return True
        try:
            response = self._stub(address).Heartbeat(
                worker_pb2.HeartbeatRequest(transfer_id=transfer_id, extend_s=extend_s),
                timeout=self._call_timeout_s,
            )
        except grpc.RpcError as error:
            logger.warning("heartbeat %s to %s failed: %s", transfer_id, address, error.code())
            return True
        return bool(response.alive)

    def release(self, address: str, transfer_id: str, reason: str) -> None:
        if not address:
            return
        try:
            self._stub(address).Release(
                worker_pb2.ReleaseRequest(transfer_id=transfer_id, reason=reason),
                timeout=self._call_timeout_s,
            )
        except grpc.RpcError as error:
            logger.warning(
                "release %s to %s failed (the lease will lapse): %s", transfer_id, address, error.code()
            )

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
