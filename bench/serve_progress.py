"""A one-line progress bar on stderr (stdout stays clean for `--json`).

On a terminal the line is redrawn in place; otherwise (a log file, CI) a line is written each
time another tenth of the phase is done, so logs stay short.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

BAR_WIDTH = 28


class ProgressBar:
    def __init__(self, label: str, total: int, stream: TextIO = sys.stderr) -> None:
        self._label = label
        self._total = max(1, total)
        self._stream = stream
        self._is_terminal = stream.isatty()
        self._done = 0
        self._last_tenth = -1
        self._started = time.monotonic()
        self._lock = threading.Lock()  # replay threads report completions concurrently
        self._draw()

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self._done = min(self._total, self._done + count)
            self._draw()

    def close(self) -> None:
        with self._lock:
            if self._is_terminal:
                self._stream.write("\n")
            elif self._done < self._total:
                self._write_line()
            self._stream.flush()

    def _draw(self) -> None:
        tenth = self._done * 10 // self._total
        if self._is_terminal:
            self._stream.write("\r" + self._line())
            self._stream.flush()
        elif tenth != self._last_tenth:
            self._last_tenth = tenth
            self._write_line()

    def _write_line(self) -> None:
        self._stream.write(self._line() + "\n")
        self._stream.flush()

    def _line(self) -> str:
        filled = self._done * BAR_WIDTH // self._total
        elapsed = time.monotonic() - self._started
        return (
            f"[bench serve] {self._label:<26} |{'#' * filled}{'.' * (BAR_WIDTH - filled)}| "
            f"{self._done}/{self._total} {elapsed:6.1f} s"
        )
