"""One engine, one thread: the only way a server touches its `LLMEngine`.

The engine is not thread-safe. gRPC handler threads never call it; they hand it a function through
`call` (and wait, always with a bound) or `submit` (fire and forget), and read a request's outputs
from the `OutputStream` opened for it. The engine thread runs queued commands, then one `step()`
when work is pending, routes each `RequestOutput` to its stream, and reports the pool occupancy
after every iteration so metrics never have to reach into the engine.

A caller that will submit a command soon (the generation worker pulling a prompt it then adds)
says so with `expect_command`: the next step boundary waits for that command, up to
`join_wait_s`, so the pulled request joins the next step instead of the one after it.

The aggregated server runs the loop on its main thread (`run_in_caller`, then `run_here`), the
thread that loaded the model: torch's OpenMP pool belongs to the thread that calls into it, and a second pool (the main
thread's, from loading) made every step of an engine on its own thread slower. Measured on the
156M model, one greedy request, median ms per token: main thread 36 to 46, engine thread alone
42 to 54, engine thread after the main thread ran one parallel op 53 to 73. The workers keep
their own engine thread; alone on their cores they too hold one pool, the process's torch threads
going to the loop thread (`on_thread_start`) and one to the main thread (docs/service.md, "The
engine thread").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import nullcontext
from typing import Any, TypeVar

from beamsplit.server.core_lease import CoreLease
from engine.types import RequestOutput

ResultT = TypeVar("ResultT")
logger = logging.getLogger(__name__)


class EngineLoopError(RuntimeError):
    """The engine thread is gone or did not answer within the bound."""


class OutputStream:
    """Outputs of one request, in order; `None` marks a stream the loop had to end (engine fault)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[RequestOutput | None] = queue.Queue()

    def put(self, output: RequestOutput | None) -> None:
        self._queue.put(output)

    def get(self, timeout_s: float) -> RequestOutput | None:
        """Next output; raises `queue.Empty` after `timeout_s`; `None` if the engine failed."""
        return self._queue.get(timeout=timeout_s)


class ExpectedCommand:
    """A command its caller will submit soon (`EngineLoop.expect_command`)."""

    def __init__(
        self, forget: Callable[[ExpectedCommand], bool], submit: Callable[[Any], Future[Any]]
    ) -> None:
        self._forget = forget
        self._submit = submit

    def submit(self, function: Callable[[Any], ResultT]) -> Future[ResultT]:
        """Submits the expected command: a boundary waiting for it steps as soon as it has run."""
        self._forget(self)
        future: Future[ResultT] = self._submit(function)
        return future

    def cancel(self) -> None:
        """No such command will come (idempotent; a no-op after submit): a boundary waiting for it
        is woken (by an empty command) and steps."""
        if self._forget(self):
            self._submit(lambda engine: None)


class EngineLoop:
    def __init__(
        self,
        engine: Any,
        on_iteration: Callable[[Any], None] | None = None,
        idle_wait_s: float = 0.02,
        name: str = "engine",
        step_delay_s: float = 0.0,
        run_in_caller: bool = False,
        on_thread_start: Callable[[], None] | None = None,
        core_lease: CoreLease | None = None,
        join_wait_s: float = 0.03,
    ) -> None:
        """join_wait_s: how long a step boundary waits for the commands callers said they would
        submit (`expect_command`); each is waited for at one boundary.
        step_delay_s: a test hook (BEAMSPLIT_TEST_STEP_DELAY_S): sleep after each step.
        run_in_caller: the loop takes commands from now on, and the caller's thread runs it later
        with `run_here` (instead of `start`). on_thread_start: runs first on the loop's own thread
        (`start`), e.g. to give that thread the process's torch threads."""
        self._engine = engine
        self._on_iteration = on_iteration
        self._idle_wait_s = idle_wait_s
        self._step_delay_s = step_delay_s
        self._commands: queue.Queue[tuple[Callable[[Any], Any], Future[Any]]] = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._streams_lock = threading.Lock()
        self._stopping = threading.Event()
        self._exited = threading.Event()
        self._thread = threading.Thread(target=self._run_on_own_thread, name=name, daemon=True)
        self._runs_in_caller = run_in_caller
        self._on_thread_start = on_thread_start
        self._core_lease = core_lease
        self._join_wait_s = join_wait_s
        self._expected: list[ExpectedCommand] = []
        self._expected_lock = threading.Lock()

    def start(self) -> None:
        """Runs the loop on a thread of its own."""
        if self._runs_in_caller:
            raise RuntimeError("this loop runs in its caller's thread: call run_here, not start")
        self._thread.start()

    def run_here(self) -> None:
        """Runs the loop on the calling thread until `stop` (a loop made with run_in_caller)."""
        if not self._runs_in_caller:
            raise RuntimeError("this loop runs on a thread of its own: call start, not run_here")
        self._thread = threading.current_thread()
        self._run()

    @property
    def num_pending_commands(self) -> int:
        """Commands queued for the engine thread (prefills, reservations, adds): a worker's queue."""
        return self._commands.qsize()

    @property
    def is_running(self) -> bool:
        if self._stopping.is_set() or self._exited.is_set():
            return False
        return self._runs_in_caller or self._thread.is_alive()

    def submit(self, function: Callable[[Any], ResultT]) -> Future[ResultT]:
        future: Future[ResultT] = Future()
        if not self.is_running:
            future.set_exception(EngineLoopError("engine loop is stopped"))
            return future
        self._commands.put((function, future))
        return future

    def call(self, function: Callable[[Any], ResultT], timeout_s: float = 30.0) -> ResultT:
        """Runs `function(engine)` on the engine thread and returns its result (or raises its error)."""
        return self.result(self.submit(function), timeout_s)

    @staticmethod
    def result(future: Future[ResultT], timeout_s: float) -> ResultT:
        """A submitted command's result within `timeout_s` (cancelled and EngineLoopError after)."""
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeoutError as error:
            future.cancel()
            raise EngineLoopError(f"engine did not answer within {timeout_s:.1f} s") from error

    def expect_command(self) -> ExpectedCommand:
        """The next step boundary waits (up to join_wait_s) for the command the caller will submit
        through the returned ExpectedCommand, or cancel. Made by a command on the engine thread
        (a reservation), it is seen by the boundary that follows that command."""
        expected = ExpectedCommand(self._forget, self.submit)
        with self._expected_lock:
            self._expected.append(expected)
        return expected

    def _forget(self, expected: ExpectedCommand) -> bool:
        """Whether `expected` was still expected."""
        with self._expected_lock:
            if expected not in self._expected:
                return False
            self._expected.remove(expected)
            return True

    def open_stream(self, request_id: str) -> OutputStream:
        stream = OutputStream(request_id)
        with self._streams_lock:
            self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        if threading.current_thread() is self._thread:
            return
        if self._runs_in_caller or self._thread.is_alive():
            self._exited.wait(timeout=timeout_s)

    def _run_on_own_thread(self) -> None:
        if self._on_thread_start is not None:
            try:
                self._on_thread_start()
            except Exception:  # a thread set-up that failed must not leave the loop dead and silent
                logger.exception("engine loop thread set-up failed")
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self._has_work())
                if self._has_work():
                    self._wait_for_expected()
                if self._has_work():
                    self._step()
                    if self._step_delay_s > 0:
                        time.sleep(self._step_delay_s)
                self._report()
            # Commands that raced with stop() must not leave their callers waiting for the full bound.
            self._run_commands(block=False)
            self._fail_all_streams()
        finally:
            self._exited.set()

    def _has_work(self) -> bool:
        try:
            return bool(self._engine.has_unfinished())
        except Exception:  # an engine that cannot answer has nothing we could step
            logger.exception("engine.has_unfinished failed")
            return False

    def _wait_for_expected(self) -> None:
        """Runs the expected commands that arrive within join_wait_s. Each is waited for at one
        boundary only (then forgotten): a slow pull costs the running requests one bounded pause."""
        deadline = time.monotonic() + self._join_wait_s
        while not self._stopping.is_set():
            with self._expected_lock:
                now = time.monotonic()
                if not self._expected or now >= deadline:
                    self._expected.clear()
                    return
            self._run_commands(block=True, timeout_s=deadline - now)

    def _run_commands(self, block: bool, timeout_s: float | None = None) -> None:
        """Runs the queued commands; block: waits for the first up to timeout_s (default idle_wait_s)."""
        wait_s = self._idle_wait_s if timeout_s is None else timeout_s
        try:
            first = self._commands.get(timeout=wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        pending = [first]
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for function, future in pending:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(self._engine))
            except BaseException as error:  # handed to the waiting caller, never lost
                future.set_exception(error)

    def _step(self) -> None:
        # A step that only hands out outputs decided outside it (a pulled request's first token)
        # runs no forward pass: it takes no turn on shared cores, where it waited for the other
        # worker's whole step (a prefill step: up to 0.9 s of the first token's latency).
        lease = None if getattr(self._engine, "has_ready_outputs", False) else self._core_lease
        try:
            with nullcontext() if lease is None else lease.turn():
                outputs = self._engine.step()
        except Exception:
            # A failed step leaves no request we can vouch for: end every stream so clients get an
            # error now; each owner aborts its request, which frees the pages.
            logger.exception("engine.step failed")
            self._fail_all_streams()
            return
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)

    def _fail_all_streams(self) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(None)

    def _report(self) -> None:
        if self._on_iteration is None:
            return
        try:
            self._on_iteration(self._engine)
        except Exception:
            logger.exception("engine loop report failed")


class RequestDroppedError(RuntimeError):
    """The engine dropped the request (`RequestOutput.error`), e.g. its pool ran out."""


def follow_stream(
    stream: OutputStream,
    stop_reason: Callable[[], Exception | None],
    silence_timeout_s: float,
    poll_interval_s: float = 0.1,
) -> Iterator[RequestOutput]:
    """Yields a request's outputs until the finished one.

    Raises what `stop_reason()` returns as soon as it returns something (client gone, shutdown),
    `RequestDroppedError` when the engine dropped the request, and `EngineLoopError` when the
    engine failed or said nothing for `silence_timeout_s`.
    """
    last_output_at = time.monotonic()
    while True:
        reason = stop_reason()
        if reason is not None:
            raise reason
        try:
            output = stream.get(poll_interval_s)
        except queue.Empty:
            if time.monotonic() - last_output_at > silence_timeout_s:
                raise EngineLoopError(f"engine produced nothing for {silence_timeout_s:.0f} s") from None
            continue
        if output is None:
            raise EngineLoopError("engine step failed")
        if output.error is not None:
            raise RequestDroppedError(output.error)
        last_output_at = time.monotonic()
        yield output
        if output.finished:
            return
