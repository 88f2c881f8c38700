"""ReceiveLane over a scripted binding: a job always ends, even when UCX fails to close its endpoint."""

from __future__ import annotations

from typing import Any

import pytest

from transfer.ucx_binding import UcxBinding
from transfer.ucx_lanes import ReceiveJob, ReceiveLane


class ScriptedBinding(UcxBinding):
    """Receives complete when `complete_all` is called; closing endpoints raises when told to."""

    name = "scripted"
    worker_address = b"scripted"

    def __init__(self, close_fails: bool) -> None:
        self.close_fails = close_fails
        self.requests: list[dict[str, Any]] = []
        self.closed: list[tuple[str, Any]] = []

    def connect(self, worker_address: bytes) -> Any:
        return object()

    def send(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        raise AssertionError("a receive lane never sends")

    def receive(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        request = {"completed": False, "error": None}
        self.requests.append(request)
        return request

    def request_state(self, request: Any) -> tuple[bool, str | None]:
        return request["completed"], request["error"]

    def complete_all(self) -> None:
        for request in self.requests:
            request["completed"] = True

    def progress(self) -> None:
        pass

    def close_endpoint(self, endpoint: Any) -> None:
        self.closed.append(("close", endpoint))
        if self.close_fails:
            raise RuntimeError("UCX refused to close")

    def cancel_and_close(self, endpoint: Any) -> None:
        self.closed.append(("cancel", endpoint))
        if self.close_fails:
            raise RuntimeError("UCX refused to cancel")

    def close(self) -> None:
        pass


def _job(lane: ReceiveLane, wakes: list[int]) -> ReceiveJob:
    job = ReceiveJob([(bytearray(8), 1), (bytearray(8), 2)], 16, lambda: wakes.append(1))
    lane.submit(job)
    lane.step()
    return job


@pytest.mark.parametrize("close_fails", [False, True])
def test_completed_job_ends_once_whether_or_not_its_endpoint_closes(close_fails: bool) -> None:
    binding = ScriptedBinding(close_fails)
    lane = ReceiveLane(binding, "lane", threaded=False)
    wakes: list[int] = []
    job = _job(lane, wakes)
    assert lane.is_busy and not job.is_finished
    binding.complete_all()
    lane.step()
    assert job.is_finished and job.error is None and wakes == [1]
    assert [kind for kind, _ in binding.closed] == ["close"]
    assert not lane.is_busy and lane.bytes_received == 16
    lane.step()  # nothing is retried
    assert len(binding.closed) == 1 and wakes == [1]


@pytest.mark.parametrize("close_fails", [False, True])
def test_cancelled_job_ends_and_says_when_its_receives_could_not_be_cancelled(close_fails: bool) -> None:
    binding = ScriptedBinding(close_fails)
    lane = ReceiveLane(binding, "lane", threaded=False)
    wakes: list[int] = []
    job = _job(lane, wakes)
    assert lane.cancel(job)
    assert [kind for kind, _ in binding.closed] == ["cancel"]
    assert wakes == [1] and not lane.is_busy and lane.bytes_received == 0
    if close_fails:
        assert job.error == "cancelled; cancelling its receives failed (UCX refused to cancel)"
    else:
        assert job.error == "cancelled"
