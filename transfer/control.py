"""The control protocol between a puller and a holder: small typed messages over one TCP connection.

One connection per pull; its lifetime is the transfer's, so a peer that dies (its kernel closes
the socket) is seen at once as end of stream. Frames are a 4-byte big-endian length and JSON.

    puller                                   holder
    PULL(id, secret, region, runs, tag_base,  ->  checks secret, region, pages; claims the offer
         lane_addresses, run_lanes,                sends one tagged message per run, run i to the
         timeout_s, checksum)                      UCX worker lane_addresses[run_lanes[i]]
                                             <-  ACCEPT(worker_address, checksum_value) or ERROR(error)
    posts one receive per run into its pages
    all receives complete (checksum checked):
    DONE                                     ->  offer ends DONE
    CANCEL(status, error) in either direction ends both sides with that status.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from dataclasses import dataclass, field, fields

_HEADER = struct.Struct("!I")
_MAX_FRAME_BYTES = 16 << 20  # a PULL for a 16k-token prompt in 16-token pages is ~20 KB


class MessageKind(str, enum.Enum):
    PULL = "pull"
    ACCEPT = "accept"
    DONE = "done"
    CANCEL = "cancel"
    ERROR = "error"


@dataclass(frozen=True)
class ControlMessage:
    kind: MessageKind
    transfer_id: str
    secret: str = ""
    region: str = ""
    runs: list[tuple[int, int]] = field(default_factory=list)  # (first source page, num pages)
    tag_base: int = 0  # run i travels with UCX tag tag_base + i
    worker_address: str = ""  # hex of the sender's UCX worker address (ACCEPT)
    lane_addresses: list[str] = field(default_factory=list)  # PULL: hex of the receiving workers
    run_lanes: list[int] = field(default_factory=list)  # PULL: run i goes to lane_addresses[run_lanes[i]]
    timeout_s: float = 0.0
    checksum: bool = False
    checksum_value: int | None = None
    status: str = ""  # a TransferStatus name, for CANCEL
    error: str = ""

    def encode(self) -> bytes:
        # Shallow on purpose: dataclasses.asdict deep-copies every run tuple, which made encoding
        # a 32-page PULL take 0.2 ms of the pull's start-up.
        values = {name: getattr(self, name) for name in _FIELD_NAMES}
        values["kind"] = self.kind.value
        payload = json.dumps(values, separators=(",", ":")).encode()
        return _HEADER.pack(len(payload)) + payload

    @staticmethod
    def decode(payload: bytes) -> ControlMessage:
        fields = json.loads(payload)
        fields["kind"] = MessageKind(fields["kind"])
        fields["runs"] = [(int(first), int(count)) for first, count in fields.get("runs", [])]
        return ControlMessage(**fields)


_FIELD_NAMES = tuple(message_field.name for message_field in fields(ControlMessage))


class ProtocolError(RuntimeError):
    pass


class Connection:
    """A framed control connection. Reads only when a selector says readable; writes are tiny."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(2.0)  # bounds sendall; reads happen only when data is waiting
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._buffer = bytearray()
        self.is_closed = False

    def send(self, message: ControlMessage) -> bool:
        """False if the peer is gone (the caller treats it like end of stream)."""
        if self.is_closed:
            return False
        try:
            self.sock.sendall(message.encode())
            return True
        except OSError:
            return False

    def receive(self) -> tuple[list[ControlMessage], bool]:
        """Messages now complete, and whether the stream has ended."""
        try:
            data = self.sock.recv(1 << 16)
        except (TimeoutError, BlockingIOError):
            return [], False
        except OSError:
            return [], True
        if not data:
            return [], True
        self._buffer += data
        messages: list[ControlMessage] = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > _MAX_FRAME_BYTES:
                raise ProtocolError(f"control frame of {length} bytes is over the limit")
            if len(self._buffer) < _HEADER.size + length:
                break
            payload = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
            del self._buffer[: _HEADER.size + length]
            try:
                messages.append(ControlMessage.decode(payload))
            except (ValueError, TypeError, KeyError) as error:
                raise ProtocolError(f"malformed control message: {error}") from error
        return messages, False

    def close(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.sock.close()
