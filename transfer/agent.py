"""The transfer contract: registered regions, offers, pulls and their status.

Rules every TransferAgent keeps (the loopback and UCX agents are tested against the same list):
- Thread-safe. No call waits without a bound; `pull` returns at once with a PullHandle.
- A holder `offer`s pages of a registered region under a random one-use secret and a lease
  (`expires_at`). The offer ends exactly once, and `on_done(transfer_id, status)` fires then:
  DONE (pulled), CANCELLED (revoked by the holder or cancelled by the puller), TIMED_OUT (lease
  lapsed, or the pull ran past its bound) or FAILED (the peer vanished, a checksum mismatch...).
- A pull with a wrong or reused secret, an unknown transfer, or pages outside the offer or outside a
  registered region is refused: the handle ends FAILED with a message saying why, and not one byte
  of the destination is written. The offer survives a wrong secret (a guess must not revoke it).
- When a handle or an offer has ended, nothing of it is left: `stats()` counts only live work.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

OnDone = Callable[[str, "TransferStatus"], None]


@dataclass(frozen=True)
class MemoryRegion:
    """`num_pages` pages of `page_bytes` each, back to back from `address` (page i at i * page_bytes)."""

    address: int
    page_bytes: int
    num_pages: int
    device: str = "cpu"  # "cpu" or "cuda:N"

    def __post_init__(self) -> None:
        if self.address <= 0 or self.page_bytes <= 0 or self.num_pages <= 0:
            raise ValueError(f"MemoryRegion needs a positive address, page_bytes and num_pages: {self}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"MemoryRegion.device must be 'cpu' or 'cuda:N', got {self.device!r}")

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages


class TransferStatus(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def is_final(self) -> bool:
        return self not in (TransferStatus.PENDING, TransferStatus.TRANSFERRING)


@dataclass(frozen=True)
class Offer:
    transfer_id: str
    secret: str  # random, one use
    address: str  # the holder agent's address ("host:port")
    expires_at: float  # time.monotonic() deadline on the holder


@dataclass(frozen=True)
class AgentStats:
    num_in_flight: int  # pulls this agent runs plus pulls it serves, not yet ended
    num_offers: int  # offers not yet ended
    reserved_bytes: int  # bytes pinned by live offers plus destination bytes of live pulls


class TransferError(RuntimeError):
    """A call the agent refuses outright (unknown region, bad page list, closed agent)."""


class PullHandle:
    """The puller's view of one pull. The agent ends it once through `_finish`; later calls are no-ops."""

    def __init__(self, transfer_id: str, reserved_bytes: int, cancel_callback: Callable[[], None]) -> None:
        self.transfer_id = transfer_id
        self.reserved_bytes = reserved_bytes
        self.bytes_moved = 0
        self.num_messages = 0
        self.error: str | None = None
        self._status = TransferStatus.PENDING
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._cancel_callback = cancel_callback

    @property
    def status(self) -> TransferStatus:
        return self._status

    def wait(self, timeout_s: float) -> TransferStatus:
        """Blocks until the pull ends or `timeout_s` passes; returns the status either way."""
        self._ended.wait(max(0.0, timeout_s))
        return self._status

    def cancel(self) -> None:
        """Stops the pull and frees both sides; a pull that already ended is left as it was."""
        if not self._status.is_final:
            self._cancel_callback()

    def _mark_transferring(self) -> None:
        with self._lock:
            if self._status is TransferStatus.PENDING:
                self._status = TransferStatus.TRANSFERRING

    def _finish(self, status: TransferStatus, error: str | None = None) -> bool:
        """Ends the handle; True only for the call that actually ended it."""
        with self._lock:
            if self._status.is_final:
                return False
            self.error = error
            self._status = status
        self._ended.set()
        return True

    def __repr__(self) -> str:
        return f"PullHandle({self.transfer_id!r}, {self._status.name}, error={self.error!r})"


class TransferAgent(ABC):
    """Moves pages between registered regions of two agents; see the module docstring for the rules."""

    address: str

    @abstractmethod
    def register(self, name: str, region: MemoryRegion) -> None: ...

    @abstractmethod
    def offer(
        self, region: str, page_ids: list[int], ttl_s: float, on_done: OnDone | None = None
    ) -> Offer: ...

    @abstractmethod
    def extend(self, transfer_id: str, ttl_s: float) -> bool:
        """Moves the lease to now + ttl_s; False if the offer has already ended."""

    @abstractmethod
    def revoke(self, transfer_id: str) -> None:
        """Cancels the offer (and a pull of it in progress) from the holder side."""

    @abstractmethod
    def pull(
        self,
        peer_address: str,
        transfer_id: str,
        secret: str,
        src_region: str,
        src_page_ids: list[int],
        dst_region: str,
        dst_page_ids: list[int],
        timeout_s: float,
        checksum: bool = False,
    ) -> PullHandle: ...

    def num_pages_pulled(self, transfer_id: str) -> int:
        """Holder side: pages a puller claimed from this offer (a subset of the offer's pages; 0 if
        never pulled or unknown). Still answers from `on_done`, for a while after the offer ended."""
        del transfer_id
        return 0

    def loop_age_s(self) -> float:
        """Seconds since the agent's event loop last came round (0 for an agent without one); the
        workers' health watchdog reports NOT_SERVING when it passes a bound."""
        return 0.0

    @abstractmethod
    def stats(self) -> AgentStats: ...

    @abstractmethod
    def close(self) -> None: ...
