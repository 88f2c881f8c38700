"""The holder's ledger of offers: secrets, leases, one-use claims, and `on_done` fired exactly once.

Both agents keep one. An offer lives from `create` until `end`; while a pull serves it the lease
is at least that pull's own bound, so an accepted pull is never cut by a lapse it could not see.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from transfer.agent import Offer, OnDone, TransferError, TransferStatus
from transfer.pages import RegionTable, check_page_ids

_logger = logging.getLogger(__name__)

# Ended transfer ids remembered so a replayed secret gets a precise refusal; bounded so a
# long-running holder does not grow without limit.
_NUM_REMEMBERED_ENDED = 4096


@dataclass
class OfferEntry:
    transfer_id: str
    secret: str
    region_name: str
    page_ids: frozenset[int]
    reserved_bytes: int
    expires_at: float
    on_done: OnDone | None
    is_claimed: bool = False
    claimed_page_ids: list[int] = field(default_factory=list)


class OfferBook:
    def __init__(self, address: str, regions: RegionTable) -> None:
        self._address = address
        self._regions = regions
        self._offers: dict[str, OfferEntry] = {}
        self._ended: OrderedDict[str, TransferStatus] = OrderedDict()
        self._ended_claims: dict[str, int] = {}  # pages claimed by the puller, for offers in _ended
        self._lock = threading.Lock()

    def create(self, region_name: str, page_ids: list[int], ttl_s: float, on_done: OnDone | None) -> Offer:
        region = self._regions.get(region_name)
        check_page_ids(page_ids, region, region_name)
        if ttl_s <= 0:
            raise TransferError(f"ttl_s must be positive, got {ttl_s}")
        entry = OfferEntry(
            transfer_id=uuid.uuid4().hex,
            secret=secrets.token_hex(16),
            region_name=region_name,
            page_ids=frozenset(page_ids),
            reserved_bytes=len(page_ids) * region.page_bytes,
            expires_at=time.monotonic() + ttl_s,
            on_done=on_done,
        )
        with self._lock:
            self._offers[entry.transfer_id] = entry
        return Offer(entry.transfer_id, entry.secret, self._address, entry.expires_at)

    def extend(self, transfer_id: str, ttl_s: float) -> bool:
        with self._lock:
            entry = self._offers.get(transfer_id)
            if entry is None:
                return False
            entry.expires_at = max(entry.expires_at, time.monotonic() + ttl_s)
            return True

    def claim(
        self, transfer_id: str, secret: str, region_name: str, page_ids: list[int], timeout_s: float
    ) -> OfferEntry:
        """Checks a pull request and marks the offer taken; raises TransferError saying why not."""
        with self._lock:
            entry = self._offers.get(transfer_id)
            if entry is None:
                ended = self._ended.get(transfer_id)
                if ended is not None:
                    raise TransferError(
                        f"transfer {transfer_id} already ended ({ended.name}): secret already used"
                    )
                raise TransferError(f"unknown transfer {transfer_id}")
            if not secrets.compare_digest(entry.secret, secret):
                raise TransferError(f"wrong secret for transfer {transfer_id}")
            if entry.is_claimed:
                raise TransferError(f"transfer {transfer_id} is already being pulled: secret already used")
            if region_name != entry.region_name:
                raise TransferError(
                    f"transfer {transfer_id} offers region {entry.region_name!r}, not {region_name!r}"
                )
            check_page_ids(page_ids, self._regions.get(region_name), region_name)
            outside = [page_id for page_id in page_ids if page_id not in entry.page_ids]
            if outside:
                raise TransferError(f"pages {outside[:8]} are not part of transfer {transfer_id}")
            entry.is_claimed = True
            entry.claimed_page_ids = list(page_ids)
            entry.expires_at = max(entry.expires_at, time.monotonic() + timeout_s)
            return entry

    def end(self, transfer_id: str, status: TransferStatus) -> bool:
        """Ends the offer and fires on_done once (outside the lock); False if it had already ended."""
        with self._lock:
            entry = self._offers.pop(transfer_id, None)
            if entry is None:
                return False
            self._ended[transfer_id] = status
            self._ended_claims[transfer_id] = len(entry.claimed_page_ids)
            while len(self._ended) > _NUM_REMEMBERED_ENDED:
                forgotten, _ = self._ended.popitem(last=False)
                self._ended_claims.pop(forgotten, None)
        if entry.on_done is not None:
            try:
                entry.on_done(transfer_id, status)
            except Exception:  # the holder's callback must not break the agent that calls it
                _logger.exception("on_done callback for transfer %s raised", transfer_id)
        return True

    def num_pages_claimed(self, transfer_id: str) -> int:
        """Pages the puller asked for (0 if none yet, or if the offer is unknown or long forgotten)."""
        with self._lock:
            entry = self._offers.get(transfer_id)
            if entry is not None:
                return len(entry.claimed_page_ids)
            return self._ended_claims.get(transfer_id, 0)

    def expired_ids(self, now: float) -> list[str]:
        with self._lock:
            return [entry.transfer_id for entry in self._offers.values() if entry.expires_at <= now]

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((entry.expires_at for entry in self._offers.values()), default=None)

    def num_offers(self) -> int:
        with self._lock:
            return len(self._offers)

    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(entry.reserved_bytes for entry in self._offers.values())

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._offers)
