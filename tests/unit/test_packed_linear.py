"""Load-time kernel warm-up and packed weights (engine/packed_linear.py): the first request after
load runs no kernel check and packs nothing, the weights are held once, and a packed layer
computes what invariant_linear computes on the dense weight."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, batch_invariant, onednn_calls
from engine.batch_invariant import RowChunkedLinear, invariant_linear
from engine.models.loader import load_model
from engine.packed_linear import PackedLinear, bytes_held, dense_weight_bytes, warm_up_linear_layers
from tests.helpers.onednn_host import NO_BFLOAT16_REASON, onednn_linear_layers, onednn_packs

pytestmark = pytest.mark.usefixtures(onednn_linear_layers.__name__)

CHECKS: tuple[Callable[..., object], ...] = (
    onednn_calls.onednn_rows_are_independent,
    onednn_calls.onednn_call_sizes,
    batch_invariant.rows_are_independent,
    batch_invariant.columns_are_independent,
)


def checks_run() -> int:
    return sum(check.cache_info().misses for check in CHECKS)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "dtype"), [("tiny", "float32"), ("tiny-hybrid", "bfloat16"), ("tiny", "float64")]
)
def test_first_request_after_load_runs_no_check_and_packs_nothing(
    model: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for check in CHECKS:
        check.cache_clear()  # type: ignore[attr-defined]
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype))
    checks_at_load = checks_run()
    assert checks_at_load > 0
    layers = list(engine.runner.model.modules())
    # float64 has no oneDNN inner product (nor bfloat16 on an AVX2-only CPU): its layers stay
    # dense and take the MKL paths.
    packs_here = onednn_packs(getattr(torch, dtype))
    assert any(isinstance(layer, PackedLinear) for layer in layers) == packs_here
    assert all(not isinstance(layer, RowChunkedLinear) for layer in layers) == packs_here
    packs: list[int] = []
    pack = onednn_calls.pack_onednn_weight
    monkeypatch.setattr(onednn_calls, "pack_onednn_weight", lambda weight: packs.append(1) or pack(weight))
    output = engine.generate(
        list(range(5, 45)), SamplingParams(beam_width=4, max_new_tokens=4, ignore_eos=True)
    )
    assert output.error is None and len(output.beams[0].token_ids) == 4
    engine.check_integrity()
    assert (checks_run(), packs) == (checks_at_load, [])


def test_warm_up_at_another_thread_count_covers_that_count() -> None:
    """A server's loop thread computes with more threads than the loading thread: warming up there
    leaves its first request nothing to check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    finally:
        torch.set_num_threads(threads)
    other = 3 if threads == 1 else threads
    torch.set_num_threads(other)
    try:
        engine.warm_up()
        checks_after_warm_up = checks_run()
        engine.generate(list(range(5, 30)), SamplingParams(beam_width=2, max_new_tokens=3))
        assert checks_run() == checks_after_warm_up
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("model", "dtype"), [("tiny", "float32"), ("tiny-hybrid", "float32"), ("tiny", "bfloat16")]
)
def test_weights_are_held_once(model: str, dtype: str) -> None:
    """The model's tensors after load (packed weights included) cost no more than 1.3x the dense
    weights in the serving dtype: no dense copy beside a packed one; a head tied to the embedding
    (tiny-hybrid) keeps the embedding's dense tensor and one packed copy."""
    dense, _, _ = load_model(model, dtype)
    weights = dense_weight_bytes(dense.state_dict())
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype))
    held = bytes_held(engine.runner.model)
    tied = engine.model_config.tie_word_embeddings
    assert held <= 1.3 * weights, (held, weights, tied)
    # Untied: exactly one copy of everything (the blocked layout adds no padding at these shapes).
    if not tied:
        assert held <= 1.01 * weights, (held, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layer_computes_what_the_dense_one_does(dtype: torch.dtype) -> None:
    if not onednn_packs(dtype):
        pytest.skip(NO_BFLOAT16_REASON)
    generator = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=True)).to(dtype)
    weight = model[0].weight.detach().clone()
    bias = model[0].bias.detach().clone()
    assert warm_up_linear_layers(batch_invariant.make_batch_invariant(model)) == 1
    layer = model[0]
    assert isinstance(layer, PackedLinear)
    assert torch.equal(layer.weight, weight)  # unpacked exactly
    assert torch.equal(model.state_dict()["0.weight"], weight)
    for num_rows in (1, 3, 4, 17):
        rows = torch.randn(num_rows, 64, generator=generator).to(dtype)
        assert torch.equal(layer(rows), invariant_linear(rows, weight, bias)), num_rows
    with pytest.raises(ValueError, match=r"\[rows, features\]"):
        layer(torch.zeros(2, 3, 64, dtype=dtype))


def test_the_direct_call_is_made_only_where_the_check_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """forward skips the checks' lookup at a thread count where the any-M check held; at another
    count it asks again, and where no oneDNN check holds there the rows take invariant_linear."""
    generator = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    weight = model[0].weight.detach().clone()
    warm_up_linear_layers(batch_invariant.make_batch_invariant(model))
    layer = model[0]
    assert isinstance(layer, PackedLinear)
    rows = torch.randn(6, 64, generator=generator)
    asked: list[int] = []
    held = onednn_calls.onednn_rows_are_independent
    threads = torch.get_num_threads()
    other = threads + 1

    def check(*shape: object) -> bool:
        asked.append(shape[-1])  # type: ignore[arg-type]
        return shape[-1] != other and held(*shape)  # type: ignore[arg-type]

    invariant_calls: list[int] = []

    def counted_invariant_linear(*args: torch.Tensor | None) -> torch.Tensor:
        invariant_calls.append(1)
        return invariant_linear(*args)  # type: ignore[arg-type]

    sizes = onednn_calls.onednn_call_sizes
    monkeypatch.setattr(onednn_calls, "onednn_rows_are_independent", check)
    monkeypatch.setattr(
        onednn_calls, "onednn_call_sizes", lambda *shape: () if shape[-1] == other else sizes(*shape)
    )
    monkeypatch.setattr(batch_invariant, "invariant_linear", counted_invariant_linear)
    expected = invariant_linear(rows, weight, None)
    assert torch.equal(layer(rows), expected) and asked == [threads] * len(asked) and asked
    asked.clear()
    for _ in range(3):
        assert torch.equal(layer(rows), expected)
    assert asked == [] and invariant_calls == []  # the direct call, nothing asked
    torch.set_num_threads(other)
    try:
        assert torch.equal(layer(rows), expected)
        assert other in asked and invariant_calls, (asked, invariant_calls)
    finally:
        torch.set_num_threads(threads)
    asked.clear()
    assert torch.equal(layer(rows), expected) and asked == []  # the first count's call is direct again
