"""The request id on every log line that concerns a request.

A handler thread (or any thread acting for a request) runs inside `request_context(request_id)`;
`RequestIdFilter`, installed on the process's log handlers by `configure_logging`, stamps each
record with `request_id=` (`-` outside any request). A context variable rather than a module
global: each thread, and each generator step, sees only its own request.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("beamsplit_request_id", default="-")


def current_request_id() -> str:
    return _request_id.get()


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    token = _request_id.set(request_id or "-")
    try:
        yield
    finally:
        _request_id.reset(token)


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        return True
