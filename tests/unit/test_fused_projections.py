"""Packed q/k/v and gate/up fused at load (engine/fused_projections.py): only where measured
exact, and then a request's beams, scores and log-probs are the separate layers' bit for bit."""

from __future__ import annotations

import pytest
import torch

import engine.llm_engine as llm_engine
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.fused_projections import fuse_packed_projections, fusion_is_exact, takes_chunks
from engine.packed_linear import PackedLinear
from tests.helpers.onednn_host import NO_BFLOAT16_REASON, onednn_packs


def beams(engine: LLMEngine) -> list[tuple[list[int], float, float]]:
    output = engine.generate(
        list(range(5, 75)), SamplingParams(beam_width=3, max_new_tokens=5, ignore_eos=True, logprobs=2)
    )
    assert output.error is None, output.error
    engine.check_integrity()
    return [(beam.token_ids, beam.score, beam.cumulative_logprob) for beam in output.beams]


def fused_names(engine: LLMEngine) -> set[str]:
    return {
        name.rsplit(".", 1)[-1]
        for name, module in engine.runner.model.named_modules()
        if name.endswith(("qkv_proj", "gate_up_proj")) and isinstance(module, PackedLinear)
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_model_decodes_the_separate_layers_bits(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = LLMEngine(EngineConfig(model="tiny", dtype=dtype))
    model = fused.runner.model
    config = fused.model_config
    q_width, kv_width = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    shapes = {
        "qkv_proj": (config.hidden_size, (q_width, kv_width, kv_width)),
        "gate_up_proj": (config.hidden_size, (config.intermediate_size,) * 2),
    }
    expected = {
        name
        for name, (in_features, widths) in shapes.items()
        if fusion_is_exact(in_features, widths, model.dtype, "cpu", torch.get_num_threads())
    }
    assert fused_names(fused) == expected
    monkeypatch.setattr(llm_engine, "fuse_packed_projections", lambda model: 0)
    separate = LLMEngine(EngineConfig(model="tiny", dtype=dtype))
    assert fused_names(separate) == set()
    assert beams(fused) == beams(separate)


def test_a_set_not_exact_at_another_thread_count_is_split_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up at a thread count where fusion is not exact splits the fused layers back into
    packed q/k/v and gate/up layers that compute what they computed before fusing."""
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32"))
    before = beams(engine)
    if not fused_names(engine):
        pytest.skip("fusion is not exact on this host: nothing was fused")
    monkeypatch.setattr("engine.fused_projections.fusion_is_exact", lambda *shape: False)
    assert fuse_packed_projections(engine.runner.model) == 0
    assert fused_names(engine) == set()
    layer = engine.runner.model.layers[0]
    assert all(
        isinstance(getattr(layer.self_attn, name), PackedLinear) for name in ("q_proj", "k_proj", "v_proj")
    )
    assert beams(engine) == before


def test_a_fused_layer_takes_the_chunks_its_parts_take() -> None:
    """bfloat16 q/k/v of the 135M model: on the AMX host the parts take oneDNN's 32-row chunks
    while the fused 576 -> 960 shape passes the any-M check; taking the chunks anyway keeps every
    row's bits (past 32 rows the two paths differ), so the set fuses."""
    widths = (576, 192, 192)
    threads = torch.get_num_threads()
    if not onednn_packs(torch.bfloat16):
        pytest.skip(NO_BFLOAT16_REASON)
    if not takes_chunks(576, widths, torch.bfloat16, threads):
        pytest.skip("no part takes the fixed-row chunks on this host")
    assert fusion_is_exact(576, widths, torch.bfloat16, "cpu", threads)
