"""Kernel checks measured in a child process (engine/kernel_facts.py): the parent adopts the child's
answers, which are the ones it would have measured itself, and its warm-up then measures nothing;
a child that fails or overruns leaves the parent to measure (nothing adopted)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import engine.llm_engine as llm_engine
import engine.packed_linear as packed_linear
from engine import EngineConfig, LLMEngine, SamplingParams, batch_invariant, fused_projections, onednn_calls
from engine.kernel_facts import CheckChild, KernelCheck, is_known, measure_in_child
from engine.packed_linear import takes_onednn_path
from tests.helpers.onednn_host import onednn_linear_layers

pytestmark = pytest.mark.usefixtures(onednn_linear_layers.__name__)

CHECKS: tuple[KernelCheck[..., object], ...] = (
    onednn_calls.onednn_rows_are_independent,
    onednn_calls.onednn_call_sizes,
    batch_invariant.rows_are_independent,
    batch_invariant.columns_are_independent,
    batch_invariant.items_are_independent,
    fused_projections.fusion_is_exact,
)


def measured_here() -> int:
    return sum(check.cache_info().misses for check in CHECKS)


@pytest.fixture(autouse=True)
def clear_checks() -> Iterator[None]:
    for check in CHECKS:
        check.cache_clear()
    yield
    for check in CHECKS:
        check.cache_clear()


SHAPES = [(48, 80, torch.float32), (48, 80, torch.bfloat16), (80, 48, torch.float64)]


def test_child_answers_are_the_ones_measured_here() -> None:
    threads = torch.get_num_threads()
    calls = [(takes_onednn_path, (inp, out, dtype, "cpu", threads)) for inp, out, dtype in SHAPES]
    assert measure_in_child(calls, threads)
    assert measured_here() == 0
    assert all(is_known(onednn_calls.onednn_rows_are_independent, *args) for _, args in calls)
    adopted = {
        (check.name, args): check(*args)
        for check in CHECKS[:4]
        for _, args in calls
        if is_known(check, *args)
    }
    # float64 has no oneDNN inner product: its shape went on to the MKL checks, in the child too.
    assert is_known(batch_invariant.rows_are_independent, *calls[2][1])
    assert measured_here() == 0
    for check in CHECKS:
        check.cache_clear()
    for _, args in calls:
        takes_onednn_path(*args)
    assert measured_here() > 0
    assert {
        (check.name, args): check(*args)
        for check in CHECKS[:4]
        for _, args in calls
        if is_known(check, *args)
    } == adopted


def test_failed_or_overrunning_child_adopts_nothing(caplog: pytest.LogCaptureFixture) -> None:
    threads = torch.get_num_threads()
    good = (takes_onednn_path, (48, 80, torch.float32, "cpu", threads))
    bad = (onednn_calls.onednn_call_sizes, (48, 80, "not a dtype", "cpu", threads))  # raises in the child
    assert not measure_in_child([good, bad], threads)
    assert "exited 1" in caplog.text and "not a dtype" in caplog.text
    assert not is_known(onednn_calls.onednn_rows_are_independent, *good[1])
    assert not measure_in_child([good], threads, timeout_s=0.05)
    assert not is_known(onednn_calls.onednn_rows_are_independent, *good[1])
    with pytest.raises(ValueError, match="engine's"):
        measure_in_child([(torch.randn, (2,))], threads)


def test_child_closed_unasked_ends_and_is_asked_once() -> None:
    child = CheckChild(packed_linear.CHECK_MODULES)
    process = child._process
    assert process is not None
    child.close()
    assert process.returncode == 0
    child.close()  # idempotent
    with pytest.raises(RuntimeError, match="asked already"):
        child.measure([], torch.get_num_threads())


@pytest.mark.parametrize("early", [True, False], ids=["started-at-config", "started-at-warm-up"])
def test_engine_with_checks_in_a_child_computes_what_one_without_does(
    monkeypatch: pytest.MonkeyPatch, early: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The tiny model is below the size that earns a child; with the bound lowered it gets one
    (started when the loader reads the config, or, where that start failed, by the warm-up): its
    warm-up and a request then measure nothing here, and every beam equals the in-process
    engine's."""
    params = SamplingParams(beam_width=3, max_new_tokens=5, ignore_eos=True)
    prompt = list(range(7, 47))
    in_process = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    assert measured_here() > 0
    expected = in_process.generate(prompt, params)
    for check in CHECKS:
        check.cache_clear()
    monkeypatch.setattr(llm_engine, "CHILD_MIN_ELEMENTS", 0)
    if early:

        def no_second_child(*args: object) -> bool:
            raise AssertionError("the warm-up started a child beside the one started at config")

        monkeypatch.setattr(packed_linear, "measure_in_child", no_second_child)
    else:

        def no_process(modules: tuple[str, ...]) -> CheckChild:
            raise OSError("no process")

        monkeypatch.setattr(llm_engine, "CheckChild", no_process)
    caplog.set_level(logging.INFO, logger="engine.kernel_facts")
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    assert "measured in a child process" in caplog.text
    output = engine.generate(prompt, params)
    assert measured_here() == 0
    engine.check_integrity()
    assert [(beam.token_ids, beam.cumulative_logprob) for beam in output.beams] == [
        (beam.token_ids, beam.cumulative_logprob) for beam in expected.beams
    ]
    # Known now: a second warm-up at this thread count starts no child.
    model = engine.runner.model
    threads = torch.get_num_threads()
    assert packed_linear.linear_checks(model, threads) == []
    assert fused_projections.fusion_checks(model, threads) == []


def test_deferred_warm_up_asks_the_load_child_at_its_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """warm_up=False (a server whose loop thread computes with other threads than the loading
    one): the child started at load waits, and the caller's warm_up() asks it at the caller's
    thread count, the only count measured; nothing is measured in the process."""
    monkeypatch.setattr(llm_engine, "CHILD_MIN_ELEMENTS", 0)
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"), warm_up=False)
    child = engine._check_child
    assert child is not None and measured_here() == 0
    assert not any(isinstance(module, packed_linear.PackedLinear) for module in engine.runner.model.modules())
    torch.set_num_threads(other)
    try:
        engine.warm_up()
        assert engine._check_child is None and child._process is None  # asked, once
        model = engine.runner.model
        assert packed_linear.linear_checks(model, other) == [] and packed_linear.linear_checks(model, threads)
        engine.generate(list(range(5, 30)), SamplingParams(beam_width=2, max_new_tokens=3))
    finally:
        torch.set_num_threads(threads)
    assert measured_here() == 0


def test_a_failed_load_ends_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_engine, "CHILD_MIN_ELEMENTS", 0)
    started: list[CheckChild] = []

    class Recorded(CheckChild):
        def __init__(self, modules: tuple[str, ...]) -> None:
            super().__init__(modules)
            started.append(self)

    def no_pool(*args: object) -> None:
        raise OSError("no memory for the pool")

    monkeypatch.setattr(llm_engine, "CheckChild", Recorded)
    monkeypatch.setattr(llm_engine.GroupedKVPool, "build", no_pool)
    with pytest.raises(OSError, match="no memory"):
        LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    assert len(started) == 1 and started[0]._process is None  # closed
