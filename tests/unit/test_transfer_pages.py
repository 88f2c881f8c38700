"""Page runs, page-list checks, the control message encoding and the offer ledger's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from transfer import MemoryRegion, TransferError, TransferStatus
from transfer.control import ControlMessage, MessageKind
from transfer.offer_book import OfferBook
from transfer.pages import PageRun, RegionTable, check_page_ids, plan_runs
from transfer.ucx_lanes import assign_lanes


def test_runs_merge_pages_adjacent_at_both_ends() -> None:
    assert plan_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [PageRun(4, 0, 3), PageRun(9, 3, 1)]
    assert plan_runs([0, 1, 2], [2, 1, 0]) == [PageRun(0, 2, 1), PageRun(1, 1, 1), PageRun(2, 0, 1)]
    with pytest.raises(TransferError, match="destination pages"):
        plan_runs([0, 1], [0])


@pytest.mark.parametrize(
    "page_ids, message",
    [([], "empty"), ([8], "outside region"), ([1, 1], "duplicate"), ([True], "not an integer")],
)
def test_page_ids_checked_against_region(page_ids: list[int], message: str) -> None:
    with pytest.raises(TransferError, match=message):
        check_page_ids(page_ids, MemoryRegion(4096, 64, 8), "kv")


def test_control_message_round_trip() -> None:
    message = ControlMessage(
        MessageKind.PULL, "t1", secret="s", region="kv", runs=[(3, 2)], tag_base=1 << 32, timeout_s=1.5
    )
    frame = message.encode()
    assert ControlMessage.decode(frame[4:]) == message


def test_offer_book_refusals_and_single_end() -> None:
    pool = np.zeros((8, 64), dtype=np.uint8)
    regions = RegionTable()
    regions.register("kv", MemoryRegion(pool.ctypes.data, 64, 8))
    ended: list[TransferStatus] = []
    book = OfferBook("here:1", regions)
    offer = book.create("kv", [1, 2], 5.0, lambda transfer_id, status: ended.append(status))
    with pytest.raises(TransferError, match="wrong secret"):
        book.claim(offer.transfer_id, "nope", "kv", [1], 1.0)
    with pytest.raises(TransferError, match="not part of"):
        book.claim(offer.transfer_id, offer.secret, "kv", [3], 1.0)
    book.claim(offer.transfer_id, offer.secret, "kv", [1, 2], 1.0)
    with pytest.raises(TransferError, match="already being pulled"):
        book.claim(offer.transfer_id, offer.secret, "kv", [1, 2], 1.0)
    assert book.end(offer.transfer_id, TransferStatus.DONE) and not book.end(
        offer.transfer_id, TransferStatus.FAILED
    )
    with pytest.raises(TransferError, match="already used"):
        book.claim(offer.transfer_id, offer.secret, "kv", [1, 2], 1.0)
    assert ended == [TransferStatus.DONE] and book.num_offers() == 0 and book.reserved_bytes() == 0


@pytest.mark.parametrize(
    ("run_bytes", "num_lanes", "expected"),
    [
        ([4, 4, 4, 4], 2, [0, 1, 0, 1]),
        ([8, 1, 1, 1], 2, [0, 1, 1, 1]),  # the big run alone on lane 0, the rest on lane 1
        ([3, 2, 1], 2, [0, 1, 1]),
        ([5, 5, 5], 1, [0, 0, 0]),
        ([1, 1], 4, [0, 1]),  # fewer runs than lanes: some lanes get nothing
    ],
)
def test_runs_go_to_the_lane_with_fewest_bytes(
    run_bytes: list[int], num_lanes: int, expected: list[int]
) -> None:
    assert assign_lanes(run_bytes, num_lanes) == expected
