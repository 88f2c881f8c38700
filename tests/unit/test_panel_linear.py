"""The panel kernel for float32 linear layers (engine/panel_linear.py): a row's outputs do not
depend on the other rows, the row count, the thread count or the other columns packed beside
them; the outputs are the product's within float32 rounding; the engine loads, fuses and serves
through it with no kernel check."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, batch_invariant, onednn_calls, panel_linear
from engine.fused_projections import fuse_packed_projections
from engine.packed_linear import PackedLinear, warm_up_linear_layers


@pytest.fixture(autouse=True)
def panels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(panel_linear.KERNEL_ENV, "panels")
    if panel_linear.native_kernels.panel_linear_kernel() is None:
        pytest.skip("the native library cannot be built here")


def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return panel_linear.panel_linear(rows, panel_linear.to_panels(weight), weight.shape[0])


@pytest.mark.parametrize(("in_features", "out_features"), [(64, 96), (576, 50), (33, 16), (7, 1)])
def test_outputs_are_the_product_and_each_row_is_alone(in_features: int, out_features: int) -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator)
    rows = torch.randn(70, in_features, generator=generator)
    outputs = product(rows, weight)
    assert outputs.shape == (70, out_features) and outputs.dtype == torch.float32
    reference = rows.double() @ weight.double().T
    assert torch.allclose(outputs.double(), reference, rtol=0, atol=1e-4 * in_features**0.5)
    # Any rows, alone or with others, at any offset and count (tiles of 6, blocks of 48): same bits.
    for first, count in ((0, 1), (5, 1), (3, 4), (1, 6), (2, 7), (0, 48), (11, 49), (0, 70)):
        assert torch.equal(product(rows[first : first + count], weight), outputs[first : first + count])
    # Rows that are not contiguous are read as they are.
    assert torch.equal(product(rows[::2], weight), outputs[::2])


def test_bits_do_not_depend_on_threads_or_on_the_columns_packed_beside() -> None:
    generator = torch.Generator().manual_seed(2)
    parts = [torch.randn(width, 80, generator=generator) for width in (40, 24, 24)]
    rows = torch.randn(13, 80, generator=generator)
    fused = product(rows, torch.cat(parts))
    assert torch.equal(fused, torch.cat([product(rows, part) for part in parts], dim=1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product(rows, torch.cat(parts))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, fused)


def test_panels_hold_the_weight_exactly_and_bad_calls_name_the_field() -> None:
    weight = torch.randn(50, 24)
    panels = panel_linear.to_panels(weight)
    assert panels.shape == (4, 24, 16) and torch.equal(panels[3, :, 2:], torch.zeros(24, 14))
    assert torch.equal(panel_linear.from_panels(panels, 50), weight)
    with pytest.raises(RuntimeError, match="input features"):
        panel_linear.panel_linear(torch.zeros(2, 23), panels, 50)
    with pytest.raises(RuntimeError, match="out_features 70"):
        panel_linear.panel_linear(torch.zeros(2, 24), panels, 70)
    with pytest.raises(RuntimeError, match="float32"):
        panel_linear.panel_linear(torch.zeros(2, 24, dtype=torch.float64), panels, 50)


def test_the_choice_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert panel_linear.panels_apply(torch.float32, "cpu")
    assert not panel_linear.panels_apply(torch.bfloat16, "cpu")
    assert not panel_linear.panels_apply(torch.float64, "cpu")
    monkeypatch.setenv(panel_linear.KERNEL_ENV, "onednn")
    assert not panel_linear.panels_apply(torch.float32, "cpu")
    monkeypatch.setenv(panel_linear.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="BEAMSPLIT_LINEAR_KERNEL='fast'"):
        panel_linear.panels_apply(torch.float32, "cpu")


def test_packed_layers_hold_panels_with_their_bias_and_fuse() -> None:
    generator = torch.Generator().manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40, bias=True))
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    packs: list[int] = []
    pack = onednn_calls.pack_onednn_weight
    try:
        onednn_calls.pack_onednn_weight = lambda w: packs.append(1) or pack(w)  # type: ignore[assignment]
        assert warm_up_linear_layers(batch_invariant.make_batch_invariant(model)) == 1
    finally:
        onednn_calls.pack_onednn_weight = pack  # type: ignore[assignment]
    layer = model[0]
    assert isinstance(layer, PackedLinear) and layer.panels and packs == []
    assert torch.equal(layer.weight, weight) and torch.equal(model.state_dict()["0.weight"], weight)
    rows = torch.randn(9, 64, generator=generator)
    assert torch.equal(layer(rows), product(rows, weight) + bias)


def test_engine_serves_through_panels_with_no_check_and_agrees_with_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 on panels: no oneDNN or MKL check at load or on the first request, every linear
    layer packed as panels and q/k/v and gate/up fused; beams equal to an engine on oneDNN's
    path to within float32's last bits (the same token ids)."""
    checks = (
        onednn_calls.onednn_rows_are_independent,
        onednn_calls.onednn_call_sizes,
        batch_invariant.rows_are_independent,
        batch_invariant.columns_are_independent,
    )
    for check in checks:
        check.cache_clear()  # type: ignore[attr-defined]
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    linear = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    assert linear and all(isinstance(m, PackedLinear) and m.panels for m in linear)
    assert fuse_packed_projections(engine.runner.model) > 0
    params = SamplingParams(beam_width=4, max_new_tokens=6, ignore_eos=True)
    output = engine.generate(list(range(5, 45)), params)
    assert output.error is None
    engine.check_integrity()
    assert sum(check.cache_info().misses for check in checks) == 0  # type: ignore[attr-defined]
    monkeypatch.setenv(panel_linear.KERNEL_ENV, "onednn")
    reference = LLMEngine(EngineConfig(model="tiny", dtype="float32")).generate(list(range(5, 45)), params)
    assert [beam.token_ids for beam in output.beams] == [beam.token_ids for beam in reference.beams]
    for beam, other in zip(output.beams, reference.beams, strict=True):
        assert beam.cumulative_logprob == pytest.approx(other.cumulative_logprob, abs=1e-4)
