"""EngineLoop: one thread owns the engine; callers wait with bounds; outputs reach their stream;
a failing step ends every stream at once. Uses a scripted engine (no model) so it runs in ms."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from beamsplit.server.engine_loop import (
    EngineLoop,
    EngineLoopError,
    ExpectedCommand,
    RequestDroppedError,
    follow_stream,
)
from engine.types import RequestOutput


class ScriptedEngine:
    """Emits `num_steps` outputs per request, one per step; records which thread called it."""

    def __init__(self, num_steps: int = 3) -> None:
        self.num_steps = num_steps
        self.remaining: dict[str, int] = {}
        self.threads: set[str] = set()
        self.fail_next_step = False
        self.drop: set[str] = set()
        self.ready: list[RequestOutput] = []  # outputs the next step returns alone, as LLMEngine's
        self.step_s = 0.0  # how long a step takes
        self.step_starts: list[float] = []  # monotonic time of each step's start

    @property
    def has_ready_outputs(self) -> bool:
        return bool(self.ready)

    def add(self, request_id: str) -> None:
        self.threads.add(threading.current_thread().name)
        self.remaining[request_id] = self.num_steps

    def has_unfinished(self) -> bool:
        return bool(self.remaining) or bool(self.ready)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.step_starts.append(time.monotonic())
        time.sleep(self.step_s)
        if self.ready:
            outputs, self.ready = self.ready, []
            return outputs
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("step failed")
        outputs = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            finished = self.remaining[request_id] == 0
            error = "dropped" if request_id in self.drop else None
            if finished or error:
                del self.remaining[request_id]
            outputs.append(RequestOutput(request_id, [[7]], finished or error is not None, error=error))
        return outputs

    def num_blocks_in_use(self) -> int:
        return len(self.remaining)


@pytest.fixture
def engine_and_loop() -> Iterator[tuple[ScriptedEngine, EngineLoop]]:
    engine = ScriptedEngine()
    reports: list[int] = []
    loop = EngineLoop(
        engine, on_iteration=lambda owned: reports.append(owned.num_blocks_in_use()), name="engine"
    )
    loop.start()
    yield engine, loop
    loop.stop()


def never() -> None:
    return None


def test_outputs_reach_their_stream_from_the_engine_thread(
    engine_and_loop: tuple[ScriptedEngine, EngineLoop],
) -> None:
    engine, loop = engine_and_loop
    streams = {request_id: loop.open_stream(request_id) for request_id in ("a", "b")}
    for request_id in streams:
        loop.call(lambda owned, request_id=request_id: owned.add(request_id))
    for stream in streams.values():
        outputs = list(follow_stream(stream, never, silence_timeout_s=5.0))
        assert [output.finished for output in outputs] == [False, False, True]
    assert engine.threads == {"engine"}


def test_call_returns_results_and_raises_errors(engine_and_loop: tuple[ScriptedEngine, EngineLoop]) -> None:
    _, loop = engine_and_loop
    assert loop.call(lambda owned: owned.num_steps + 1) == 4
    with pytest.raises(KeyError):
        loop.call(lambda owned: owned.remaining["missing"])


def test_call_is_bounded(engine_and_loop: tuple[ScriptedEngine, EngineLoop]) -> None:
    _, loop = engine_and_loop
    started = time.monotonic()
    with pytest.raises(EngineLoopError):
        loop.call(lambda owned: time.sleep(0.5), timeout_s=0.1)
    assert time.monotonic() - started < 0.4


def test_failed_step_ends_every_stream(engine_and_loop: tuple[ScriptedEngine, EngineLoop]) -> None:
    engine, loop = engine_and_loop
    stream = loop.open_stream("a")
    loop.call(lambda owned: (owned.add("a"), setattr(owned, "fail_next_step", True)))
    with pytest.raises(EngineLoopError):
        list(follow_stream(stream, never, silence_timeout_s=5.0))


def test_dropped_request_and_stop_reason(engine_and_loop: tuple[ScriptedEngine, EngineLoop]) -> None:
    engine, loop = engine_and_loop
    stream = loop.open_stream("dropped")
    loop.call(lambda owned: (owned.drop.add("dropped"), owned.add("dropped")))
    with pytest.raises(RequestDroppedError):
        list(follow_stream(stream, never, silence_timeout_s=5.0))
    quiet = loop.open_stream("quiet")
    with pytest.raises(TimeoutError):
        list(follow_stream(quiet, lambda: TimeoutError("client gone"), silence_timeout_s=5.0))
    with pytest.raises(EngineLoopError):
        list(follow_stream(quiet, never, silence_timeout_s=0.2))


def test_stopped_loop_refuses_work_and_ends_streams() -> None:
    loop = EngineLoop(ScriptedEngine())
    loop.start()
    stream = loop.open_stream("a")
    loop.stop()
    assert stream.get(timeout_s=1.0) is None
    with pytest.raises(EngineLoopError):
        loop.call(lambda owned: None, timeout_s=1.0)
    with pytest.raises(queue.Empty):
        stream.get(timeout_s=0.01)


def test_a_loop_run_in_its_caller_takes_commands_before_it_runs() -> None:
    """The aggregated server's way: commands queue while the main thread finishes its set-up, and
    run once that thread enters run_here; start and run_here each refuse the other kind of loop."""
    loop = EngineLoop(ScriptedEngine(), run_in_caller=True)
    assert loop.is_running
    future = loop.submit(lambda owned: threading.current_thread().name)
    with pytest.raises(RuntimeError, match="run_here"):
        loop.start()
    caller = threading.Thread(target=loop.run_here, name="caller", daemon=True)
    caller.start()
    try:
        assert future.result(timeout=5.0) == "caller"
    finally:
        loop.stop()
        caller.join(timeout=5.0)
    assert not caller.is_alive() and not loop.is_running
    with pytest.raises(RuntimeError, match="start"):
        EngineLoop(ScriptedEngine()).run_here()


def expected_while_running(join_wait_s: float) -> tuple[ScriptedEngine, EngineLoop, int, ExpectedCommand]:
    """A started loop stepping one long request every 0.1 s, the steps made so far, and a command
    expected from a command on the engine thread (as the generation worker's reservation does)."""
    engine = ScriptedEngine(num_steps=10_000)
    engine.step_s = 0.1
    loop = EngineLoop(engine, join_wait_s=join_wait_s)
    loop.start()
    loop.call(lambda owned: owned.add("running"))
    steps, expected = loop.call(lambda owned: (len(owned.step_starts), loop.expect_command()))
    return engine, loop, steps, expected


def test_an_expected_command_joins_the_next_step() -> None:
    """A request added through an expected command (a pulled prompt) joins the step after the
    command that expected it, though it comes three steps' time later: the boundary waited."""
    engine, loop, steps, expected = expected_while_running(join_wait_s=5.0)
    try:
        time.sleep(0.3)  # the pull
        added = expected.submit(lambda owned: (owned.add("pulled"), len(owned.step_starts))[1])
        assert loop.result(added, timeout_s=5.0) == steps
        expected.cancel()  # after submit: nothing more to wake
        stream = loop.open_stream("pulled")
        assert stream.get(timeout_s=5.0) is not None
    finally:
        loop.stop()


def test_a_boundary_waits_for_an_expected_command_once_and_within_its_bound() -> None:
    """A command that does not come holds one boundary for join_wait_s and no other; one
    cancelled wakes the boundary waiting for it at once."""
    engine, loop, steps, expected = expected_while_running(join_wait_s=0.5)
    try:
        time.sleep(1.2)
        starts = engine.step_starts[steps:]
        assert len(starts) >= 5  # ~0.5 s waited, then a step every 0.1 s
        assert starts[0] - engine.step_starts[steps - 1] >= 0.5
        assert max(later - earlier for earlier, later in zip(starts, starts[1:], strict=False)) < 0.3
        expected.cancel()

        _, cancelled = loop.call(lambda owned: (None, loop.expect_command()))
        asked = time.monotonic()
        cancelled.cancel()
        next_step = len(engine.step_starts)
        deadline = time.monotonic() + 5.0
        while len(engine.step_starts) <= next_step and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.step_starts[next_step] - asked < 0.3  # not join_wait_s later
    finally:
        loop.stop()


@pytest.fixture
def leased_loop(tmp_path: Path) -> Iterator[tuple[Any, ScriptedEngine, EngineLoop]]:
    """A started loop over a one-step scripted engine, with a core lease, and another holder of
    the same lease (the other worker)."""
    from beamsplit.server.core_lease import CoreLease

    other = CoreLease(tmp_path / "cores.lock")
    engine = ScriptedEngine(num_steps=1)
    loop = EngineLoop(engine, core_lease=CoreLease(tmp_path / "cores.lock"))
    loop.start()
    try:
        yield other, engine, loop
    finally:
        loop.stop()
        other.close()


def test_a_loop_with_a_core_lease_steps_only_in_its_turn(
    leased_loop: tuple[Any, ScriptedEngine, EngineLoop],
) -> None:
    """Each step waits for the process's turn on the shared cores: while another holder has them,
    commands still run (adds, aborts) but no step does; the step follows the release."""
    other, engine, loop = leased_loop
    with other.turn():
        stream = loop.open_stream("r")
        loop.call(lambda owned: owned.add("r"), timeout_s=5.0)  # commands need no turn
        with pytest.raises(queue.Empty):
            stream.get(timeout_s=0.3)  # the step waits for the turn
        assert engine.remaining == {"r": 1}
    output = stream.get(timeout_s=5.0)
    assert output is not None and output.finished and not engine.remaining


def test_a_step_without_a_forward_pass_takes_no_turn(
    leased_loop: tuple[Any, ScriptedEngine, EngineLoop],
) -> None:
    """A pulled request's first token (an output decided outside the step) reaches its stream
    while the other worker holds the cores; the request's next step, a forward pass, waits."""
    other, engine, loop = leased_loop

    def pulled(owned: ScriptedEngine) -> None:
        owned.ready.append(RequestOutput("r", [[5]], False))
        owned.add("r")

    with other.turn():
        stream = loop.open_stream("r")
        loop.call(pulled, timeout_s=5.0)
        first = stream.get(timeout_s=5.0)
        assert first is not None and first.new_token_ids == [[5]] and not first.finished
        with pytest.raises(queue.Empty):
            stream.get(timeout_s=0.3)  # the forward step waits for the turn
        assert engine.remaining == {"r": 1}
    output = stream.get(timeout_s=5.0)
    assert output is not None and output.finished and not engine.remaining


@pytest.mark.parametrize("takes_turns", [False, True])
def test_a_worker_engine_thread_takes_the_torch_threads_alone_on_its_cores(
    takes_turns: bool, tmp_path: Path
) -> None:
    """start_engine for a worker (loop on its own thread): the loop thread gets the process's
    torch threads and the thread that loaded the model keeps one, so the process holds one
    OpenMP pool (two made libgomp's barriers slower and every decode step with them), whether
    the worker has its cores to itself or takes turns on them with another (a core lease, whose
    turn the warm-up waits for too)."""
    import torch

    from beamsplit.server.core_lease import CoreLease
    from beamsplit.server.metrics import ServerMetrics
    from beamsplit.server.worker_setup import start_engine
    from engine import CacheConfig, EngineConfig, SamplingParams
    from engine.batch_invariant import RowChunkedLinear
    from engine.packed_linear import PackedLinear

    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)  # one thread would not tell the layouts apart
    num_threads = torch.get_num_threads()
    config = EngineConfig(
        model="tiny", dtype="float32", cache=CacheConfig(tokens_per_block=16, num_blocks=64)
    )
    lease = CoreLease(tmp_path / "cores.lock", wait_bound_s=0.2) if takes_turns else None
    metrics = ServerMetrics("generation")
    released_at = 0.0
    if (
        lease is not None
    ):  # the warm-up waits for its turn (the other worker's warm-up), past the steps' bound
        holder = CoreLease(tmp_path / "cores.lock")
        holding = holder.turn()
        holding.__enter__()

        def release() -> None:
            nonlocal released_at
            time.sleep(3.0)  # the tiny model loads in well under this
            released_at = time.monotonic()
            holding.__exit__(None, None, None)
            holder.close()

        threading.Thread(target=release, daemon=True).start()
    handle = start_engine(config, metrics, core_lease=lease)
    if lease is not None:
        assert 0 < released_at <= time.monotonic()
    try:
        assert torch.get_num_threads() == 1
        assert handle.loop.call(lambda engine: torch.get_num_threads(), timeout_s=30.0) == num_threads
        # Warmed up (checked and packed) before start_engine returns: on the loop thread alone
        # on its cores (LLMEngine(warm_up=False), then warm_up() there), else in the constructor.
        modules = list(handle.engine.runner.model.modules())
        assert any(isinstance(module, PackedLinear) for module in modules)
        assert not any(isinstance(module, RowChunkedLinear) for module in modules)
        assert metrics.registry.get_sample_value("beamsplit_core_turns_skipped") == 0
        if lease is not None:  # a step whose turn another holder keeps past the bound runs, counted
            other = CoreLease(tmp_path / "cores.lock")
            with other.turn():
                stream = handle.loop.open_stream("r")
                params = SamplingParams(max_new_tokens=1)
                handle.loop.call(lambda engine: engine.add_request("r", [5, 6, 7], params), timeout_s=10.0)
                output = stream.get(timeout_s=30.0)
            other.close()
            assert output is not None and output.finished
            assert metrics.registry.get_sample_value("beamsplit_core_turns_skipped") == 1
    finally:
        handle.loop.stop()
        torch.set_num_threads(before)


def test_the_launcher_starts_engine_processes_as_sharing_their_cores_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-host launch gives the context and generation workers and an aggregated server beside
    them (the demo's) --shares-cores (they take turns on the same cores, through the group's lock
    file); the coordinator takes no such flag; a group whose workers never compute at once (bench
    service) leaves it off."""
    import subprocess

    from beamsplit.launch import launcher

    commands: dict[str, list[str]] = {}

    class FakePopen:
        def __init__(self, command: list[str], **kwargs: object) -> None:
            commands[command[command.index("serve") + 1]] = command
            self.pid = 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    log_dir = Path("/tmp/beamsplit-test-launcher-flags")
    group = launcher.ProcessGroup(log_dir)
    for role in ("context", "generation", "aggregated", "coordinator"):
        group.start(role, role, [])
    assert all("--shares-cores" in commands[role] for role in launcher.ENGINE_ROLES)
    # They take turns on one lock file, the group's own (not the host's default).
    lease_files = {
        commands[role][commands[role].index("--core-lease-file") + 1] for role in launcher.ENGINE_ROLES
    }
    assert lease_files == {str(log_dir / "cores.lock")}
    assert "--shares-cores" not in commands["coordinator"]
    alone = launcher.ProcessGroup(log_dir, workers_share_cores=False)
    alone.start("generation", "generation", [])
    assert "--shares-cores" not in commands["generation"]
    group.processes.clear()  # nothing was started
    alone.processes.clear()
