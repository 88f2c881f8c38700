"""The window-aware KV cache through LLMEngine, float64, on tiny Gemma 3 and Mistral checkpoints
(sliding window 8, blocks 16; tests/helpers/family_checkpoints.py).

- blocks held per KV group after prefill and at every decode step, pinned for known sizes;
- the beams equal the all-full layout's exactly and transformers' (prompts up to 3x the window
  and past it, chunked prefill, prefix reuse), check_integrity after every step;
- the disaggregated entry points refuse the window-aware layout by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache import HOLE
from tests.helpers.family_checkpoints import SLIDING_WINDOW, load_reference, write_family_checkpoint
from tests.helpers.hf_reference import assert_engine_beams_equal, reference_case

transformers = pytest.importorskip("transformers")

T = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        family: write_family_checkpoint(tmp_path_factory.mktemp(family), family, seed=3 + index)
        for index, family in enumerate(("gemma3", "mistral"))
    }


@pytest.fixture(autouse=True)
def few_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(directory: Path, window_aware: bool = True, **engine_options: int) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=T, num_blocks=48, sliding_window_kv=window_aware)
    return LLMEngine(EngineConfig(model=str(directory), dtype="float64", cache=cache, **engine_options))


def run_recording_blocks(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list, list]:
    """Steps one request to its end, check_integrity after every step; returns its beams and, per
    step, (num_tokens, blocks held per group, group 1's tables or [])."""
    engine.add_request("r", prompt, params)
    held = []
    while True:
        outputs = engine.step()
        engine.check_integrity()
        for request in engine.scheduler.running:
            tables = [list(table.tables[-1].block_ids) for table in request.tables]
            held.append((request.tables[0].num_tokens, request.num_group_blocks_held(), tables))
        for output in outputs:
            if output.finished:
                assert engine.num_blocks_in_use() == 0
                return output.beams, held


def test_gemma3_blocks_held_per_group(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["gemma3"])
    # Layer 1 is full attention, layers 0 and 2 slide: two groups, the sliding pages hold 2 layers.
    assert [(group.window, group.layer_indices) for group in engine.kv_cache.groups] == [
        (None, (1,)),
        (8, (0, 2)),
    ]
    assert engine.group_page_bytes[1] == 2 * engine.group_page_bytes[0]
    params = SamplingParams(beam_width=3, max_new_tokens=24, ignore_eos=True)
    beams, held = run_recording_blocks(engine, list(range(3, 43)), params)
    # After the 40-token prefill the first query is at 40: blocks 0 and 1 (keys 0..31) are dead.
    assert held[0] == (40, (3, 1), [[HOLE, HOLE, 2]])
    # The three beams share the full group's 2 prompt blocks and copy its 8-token tail; the
    # sliding group copies its tail only, the holes stay holes.
    assert held[1] == (41, (5, 3), [[HOLE, HOLE, 2], [HOLE, HOLE, 3], [HOLE, HOLE, 4]])
    assert [entry[0] for entry in held] == list(range(40, 63))
    for num_tokens, (_, num_sliding), tables in held:
        # The query at num_tokens - 1 sees keys num_tokens - 8 .. num_tokens - 1: every beam holds
        # exactly the blocks those fall in, the rest are holes.
        num_dead = max(0, (num_tokens - SLIDING_WINDOW) // T)
        for table in tables:
            assert len(table) == -(-num_tokens // T)
            assert table[:num_dead] == [HOLE] * num_dead and HOLE not in table[num_dead:], (num_tokens, table)
        if num_dead == len(tables[0]) - 1 and len(tables) == 3:
            assert num_sliding == 3, num_tokens  # one private block per beam
    full_beams, full_held = run_recording_blocks(
        make_engine(checkpoints["gemma3"], False), list(range(3, 43)), params
    )
    # The all-full layout: one group of every layer, nothing released, the same beams bit for bit.
    assert full_held[0][:2] == (40, (3,))
    # ... whose one group holds, step by step, what the window-aware full group holds.
    assert [(entry[0], entry[1][0]) for entry in full_held] == [(entry[0], entry[1][0]) for entry in held]
    assert [(beam.token_ids, beam.score) for beam in beams] == [
        (beam.token_ids, beam.score) for beam in full_beams
    ]


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_beams_match_transformers_with_chunks_and_prefix_reuse(
    checkpoints: dict[str, Path], family: str
) -> None:
    """Prompts of 1x to 3x the window and past it, prefilled in chunks of at most 16 tokens, and a
    second request reusing the first one's prefix (the sliding group's published blocks are cached
    after their release, so they are reused too)."""
    directory = checkpoints[family]
    reference = load_reference(family, directory, torch.float64)
    engine = make_engine(directory, max_num_seqs=4, max_num_batched_tokens=16)
    generator = torch.Generator().manual_seed(11)
    vocab_size = reference.config.vocab_size
    base = torch.randint(3, vocab_size, (3 * SLIDING_WINDOW + 13,), generator=generator).tolist()
    cases = [
        (base[:SLIDING_WINDOW], 2),
        (base[: 3 * SLIDING_WINDOW], 3),
        (base, 4),
        (base[:33] + [5, 6, 7], 2),
    ]
    reused = []
    for prompt, width in cases:
        params = SamplingParams(beam_width=width, max_new_tokens=12, ignore_eos=True, early_stopping=True)
        expected, eos_token_id = reference_case(reference, prompt, params, False)
        params = replace(params, eos_token_id=eos_token_id, ignore_eos=eos_token_id is None)
        before = engine.kv_cache.stats.reused_tokens
        assert_engine_beams_equal(engine, prompt, params, expected, 1e-9)
        reused.append(engine.kv_cache.stats.reused_tokens - before)
    # The 37-token prompt shares 32 tokens (2 full blocks) with the earlier 3x-window ones.
    assert reused[3] == 32, reused


def test_disaggregated_entry_points_need_the_one_group_layout(checkpoints: dict[str, Path]) -> None:
    engine = make_engine(checkpoints["gemma3"])
    with pytest.raises(ValueError, match="sliding_window_kv=False"):
        engine.add_prefill("p", [3, 4, 5], 4)
    with pytest.raises(ValueError, match="sliding_window_kv=False"):
        engine.reserve_prompt("g", [3, 4, 5])
    one_group = make_engine(checkpoints["gemma3"], False)
    result = one_group.prefill("p", list(range(3, 43)), 4)
    assert result.block_ids == [0, 1, 2]  # every block kept: what the workers ship today
    one_group.release_prefill("p")
    assert one_group.num_blocks_in_use() == 0
