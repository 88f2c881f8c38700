"""OfferBook, the holder's ledger both agents share: a secret opens its own offer, once, and nothing
after the offer ended, even once the book has forgotten the offer."""

from __future__ import annotations

import numpy as np
import pytest

from transfer import MemoryRegion, TransferError, TransferStatus
from transfer.offer_book import OfferBook
from transfer.pages import RegionTable


@pytest.fixture
def pool() -> np.ndarray:
    return np.zeros((8, 64), dtype=np.uint8)


@pytest.fixture
def book(pool: np.ndarray) -> OfferBook:
    regions = RegionTable()
    regions.register("kv", MemoryRegion(pool.ctypes.data, 64, 8))
    return OfferBook("here:1", regions)


def test_secrets_are_random_and_open_only_their_own_offer(book: OfferBook) -> None:
    first, second = book.create("kv", [1], 5.0, None), book.create("kv", [2], 5.0, None)
    assert first.secret != second.secret and len(first.secret) == 32  # 128 random bits each
    for secret in ("", second.secret, first.secret[:-1], first.secret.upper() + "0"):
        with pytest.raises(TransferError, match="wrong secret"):
            book.claim(first.transfer_id, secret, "kv", [1], 1.0)
    book.claim(first.transfer_id, first.secret, "kv", [1], 1.0)
    assert book.num_offers() == 2


@pytest.mark.parametrize("status", list(TransferStatus)[2:])  # DONE, FAILED, CANCELLED, TIMED_OUT
def test_a_secret_opens_nothing_after_its_offer_ended(book: OfferBook, status: TransferStatus) -> None:
    offer = book.create("kv", [1, 2], 5.0, None)
    assert book.end(offer.transfer_id, status)
    with pytest.raises(TransferError, match=f"already ended \\({status.name}\\): secret already used"):
        book.claim(offer.transfer_id, offer.secret, "kv", [1, 2], 1.0)


def test_a_forgotten_offer_stays_closed(book: OfferBook) -> None:
    first = book.create("kv", [1], 5.0, None)
    book.end(first.transfer_id, TransferStatus.DONE)
    for _ in range(5000):  # more ended offers than the book remembers (4096)
        book.end(book.create("kv", [2], 5.0, None).transfer_id, TransferStatus.DONE)
    with pytest.raises(TransferError, match="unknown transfer"):
        book.claim(first.transfer_id, first.secret, "kv", [1], 1.0)
    assert book.num_offers() == 0 and book.reserved_bytes() == 0
