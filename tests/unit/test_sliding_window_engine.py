"""The window-aware KV cache through LLMEngine, float64, on tiny Gemma 3 and Mistral checkpoints
(sliding window 8, blocks 16; tests/helpers/family_checkpoints.py).

- blocks held per KV group after prefill and at every decode step, pinned for known sizes;
- the beams equal the all-full layout's exactly and transformers' (prompts up to 3x the window
  and past it, chunked prefill, prefix reuse), check_integrity after every step;
- disaggregated in process: only the window's pages move, per group, and the beams equal the
  aggregated ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.block_allocator import PoolTooSmallError
from engine.kv_cache import HOLE, OutOfBlocksError
from engine.kv_group_tables import pages_to_pull
from engine.types import PrefillResult, PromptReservation
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
    # Layer 1 is full attention, layers 0 and 2 slide: groups of 1 layer (pages of one size), one
    # full and two of window 8, all in one pool of 1-layer pages.
    assert [(group.window, group.layer_indices) for group in engine.kv_cache.groups] == [
        (None, (1,)),
        (8, (0,)),
        (8, (2,)),
    ]
    params = SamplingParams(beam_width=3, max_new_tokens=24, ignore_eos=True)
    beams, held = run_recording_blocks(engine, list(range(3, 43)), params)
    # After the 40-token prefill the first query is at 40: blocks 0 and 1 (keys 0..31) are dead in
    # each sliding group (the last group's pages 6 and 7, published, are cached for reuse).
    assert held[0] == (40, (3, 1, 1), [[HOLE, HOLE, 8]])
    # The three beams share the full group's 2 prompt blocks and copy its 8-token tail; each
    # sliding group copies its tail only (fresh pages 13 and 14: the cached ones stay), the holes
    # stay holes.
    assert held[1] == (41, (5, 3, 3), [[HOLE, HOLE, 8], [HOLE, HOLE, 13], [HOLE, HOLE, 14]])
    assert [entry[0] for entry in held] == list(range(40, 63))
    for num_tokens, (_, _, num_sliding), tables in held:
        # The query at num_tokens - 1 sees keys num_tokens - 8 .. num_tokens - 1: every beam holds
        # exactly the blocks those fall in, the rest are holes.
        num_dead = max(0, (num_tokens - SLIDING_WINDOW) // T)
        for table in tables:
            assert len(table) == -(-num_tokens // T)
            assert table[:num_dead] == [HOLE] * num_dead and HOLE not in table[num_dead:], (num_tokens, table)
        if num_dead == len(tables[0]) - 1 and len(tables) == 3:
            assert num_sliding == 3, num_tokens  # one private block per beam
    full_engine = make_engine(checkpoints["gemma3"], False)
    assert full_engine.page_bytes == 3 * engine.page_bytes  # every layer in an all-full page
    full_beams, full_held = run_recording_blocks(full_engine, list(range(3, 43)), params)
    # The all-full layout: one group of every layer, nothing released, the same beams bit for bit.
    assert full_held[0][:2] == (40, (3,))
    # ... whose one group holds, step by step, what the window-aware full group holds.
    assert [(entry[0], entry[1][0]) for entry in full_held] == [(entry[0], entry[1][0]) for entry in held]
    assert [(beam.token_ids, beam.score) for beam in beams] == [
        (beam.token_ids, beam.score) for beam in full_beams
    ]


@pytest.mark.parametrize("window_aware", [True, False])
def test_a_chunked_prompt_holds_only_its_window_and_chunk_per_sliding_group(
    checkpoints: dict[str, Path], window_aware: bool
) -> None:
    """A 100-token prompt in chunks of 20 (window 8, blocks 16): at each chunk's forward the full
    group holds the whole prompt, the sliding group only the blocks the chunk writes and those its
    first query still sees, at most ceil((8 + 20)/16) + 1 = 3 (ceil(100/16) = 7 before)."""
    engine = make_engine(checkpoints["gemma3"], window_aware, max_num_seqs=2, max_num_batched_tokens=20)
    forward = engine.runner.forward
    held: list[tuple[int, tuple[int, ...]]] = []

    def recording_forward(seqs):  # type: ignore[no-untyped-def]
        for request in engine.scheduler.running:
            held.append((request.num_computed_tokens, request.num_group_blocks_held()))
        return forward(seqs)

    engine.runner.forward = recording_forward  # type: ignore[method-assign]
    prompt = [3 + index % 90 for index in range(100)]
    params = SamplingParams(beam_width=2, max_new_tokens=4, ignore_eos=True)
    beams, _ = run_recording_blocks(engine, prompt, params)
    if window_aware:
        # chunk [0, 20): blocks 0, 1; [20, 40): query 20 still sees block 0, blocks 0..2; [40, 60):
        # blocks 2, 3; [60, 80): 3, 4; [80, 100): 4..6, in each sliding group. Then 2 beams of
        # ceil(8/16) + 1 blocks.
        sliding_held = [2, 3, 2, 2, 3]
        assert held[:5] == [
            (start, (7, n, n)) for start, n in zip(range(0, 100, 20), sliding_held, strict=True)
        ]
        assert max(max(counts[1:]) for _, counts in held) <= -(-(8 + 20) // T) + 1
        # Each of the 7 prompt blocks was taken once, when its chunk ran; then the second beam's
        # copy of the tail (tokens 100..103 stay in block 6: no decode growth).
        assert [manager.stats.new_blocks for manager in engine.kv_cache.managers[1:]] == [7 + 1, 7 + 1]
    else:
        assert held[:5] == [(start, (7,)) for start in range(0, 100, 20)]
    full_engine = make_engine(checkpoints["gemma3"], False, max_num_seqs=2, max_num_batched_tokens=20)
    full_beams, _ = run_recording_blocks(full_engine, prompt, params)
    assert [(beam.token_ids, beam.score) for beam in beams] == [
        (beam.token_ids, beam.score) for beam in full_beams
    ]


def run_concurrently(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, int]:
    """Every prompt queued at once, stepped to the end with check_integrity after every step (the
    scheduler's asserts each request's blocks per group against its bound); returns each request's
    beams and the most requests that ran (admitted, holding blocks) at once."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    beams, most_running = {}, 0
    while len(beams) < len(prompts):
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                beams[output.request_id] = [(beam.token_ids, beam.score) for beam in output.beams]
        engine.check_integrity()
        most_running = max(most_running, len(engine.scheduler.running))
    assert engine.num_blocks_in_use() == 0
    return beams, most_running


def test_one_byte_budget_admits_at_least_as_many_and_more_long_prompts(checkpoints: dict[str, Path]) -> None:
    """One byte budget, the bytes of 48 all-full pages (3 layers each): the window-aware pool has
    144 pages of 1 layer, shared by its 3 groups. Through the real scheduler (chunks of 32, at
    most 32 beams, 2 per request, 3 new tokens), check_integrity after every step:
    - 24-token prompts: all-full, 1 shared + 2 x 1 = 3 pages, 16 at once; window-aware 3 pages in
      each group (the window never needs more than the full layout), 9 of 144: 16 at once too.
    - 400-token prompts: all-full 25 + 2 x 1 = 27 of 48 pages, one at a time; window-aware
      27 + 2 x 4 (in each window group: 2 beams x ceil(8/16) + 1 decoding, and as many for a
      chunk, ceil((8 + 32)/16) + 1) = 35 of 144: 4 at once.
    The beams equal the all-full run's bit for bit."""
    directory = checkpoints["gemma3"]
    page_bytes = make_engine(directory, False).page_bytes  # one all-full page, all 3 layers
    budget = CacheConfig(T, 1, max_pool_bytes=48 * page_bytes, is_sized_by_memory=True)
    generator = torch.Generator().manual_seed(5)
    cases = {24: 18, 400: 5}  # prompt length: requests queued at once
    params = SamplingParams(beam_width=2, max_new_tokens=3, ignore_eos=True)
    runs = {}
    for prompt_len, num_requests in cases.items():
        prompts = [
            torch.randint(3, 90, (prompt_len,), generator=generator).tolist() for _ in range(num_requests)
        ]
        for window_aware in (True, False):
            cache = replace(budget, sliding_window_kv=window_aware)
            config = EngineConfig(
                model=str(directory), dtype="float64", cache=cache, max_num_seqs=32, max_num_batched_tokens=32
            )
            engine = LLMEngine(config)
            runs[prompt_len, window_aware] = (
                engine.kv_cache.num_blocks(),
                *run_concurrently(engine, prompts, params),
            )
    assert runs[24, False][0] == 48 and runs[24, True][0] == 3 * 48
    assert (runs[24, False][2], runs[24, True][2]) == (16, 16)
    assert (runs[400, False][2], runs[400, True][2]) == (1, 4)
    for prompt_len in cases:
        assert runs[prompt_len, True][1] == runs[prompt_len, False][1]  # the same beams, bit for bit


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


def pull_pages(
    context: LLMEngine, generation: LLMEngine, prefill: PrefillResult, reservation: PromptReservation
) -> int:
    """The "pull", in process, as the workers run it: the holder offers prefill.region_page_ids of
    its transfer region, the puller reads the positions its reservation names into its own region
    pages (engine/region_pages.py). Returns the bytes moved."""
    src_region, dst_region = context.kv_region(), generation.kv_region()
    assert src_region.page_bytes == dst_region.page_bytes
    assert len(prefill.region_page_ids) == reservation.num_source_pages
    src_ids = [prefill.region_page_ids[position] for position in reservation.source_positions]
    page = src_region.page_bytes
    assert page == context.kv_pool.page_bytes  # the region's page is the pool's
    src_pages = context.kv_pool.data.view(torch.uint8).view(-1, page)  # [pages, page bytes]
    dst_pages = generation.kv_pool.data.view(torch.uint8).view(-1, page)
    dst_pages[reservation.region_page_ids] = src_pages[src_ids]
    # The same pages as the per-group view names them.
    pairs = pages_to_pull(prefill.group_page_ids, reservation.group_page_ids, reservation.num_cached_blocks)
    assert [page_id for src, _ in pairs for page_id in src] == src_ids
    assert [page_id for _, dst in pairs for page_id in dst] == reservation.region_page_ids
    return len(src_ids) * page


@pytest.mark.parametrize("beam_width", [1, 4])
def test_disaggregated_ships_only_the_window_and_equals_aggregated(
    checkpoints: dict[str, Path], beam_width: int
) -> None:
    """Gemma 3 tiny, a 40-token prompt (5x the window): the context side pins, per group, only the
    pages inside the window at the prompt's end; the generation side reserves the same positions
    (holes elsewhere), pulls them and decodes the aggregated beams exactly. The bytes moved do not
    depend on W: 3 pages of the full layer and 1 page of each sliding layer's group, 5/9 of the 3
    pages of 3 layers the all-full layout ships."""
    directory = checkpoints["gemma3"]
    prompt = list(range(5, 45))
    params = SamplingParams(beam_width=beam_width, max_new_tokens=12, ignore_eos=True)
    aggregated = make_engine(directory).generate(prompt, params)
    context, generation = make_engine(directory), make_engine(directory)
    prefill = context.prefill("r", prompt, params.num_candidates)
    assert prefill.group_page_ids == ((0, 1, 2), (HOLE, HOLE, 5), (HOLE, HOLE, 8))
    assert context.kv_cache.num_group_blocks_in_use() == (3, 1, 1)
    # Metrics and status: per attention kind, the window groups summed, of the one pool's 48.
    counters = context.counters()
    assert (counters.group_names, counters.group_blocks_in_use) == (("full", "window8"), (3, 2))
    assert counters.group_blocks_total == (48, 48) and counters.num_blocks_total == 48
    context.check_integrity()
    reservation = generation.reserve_prompt("r", prompt, params=params)
    # Each sliding group takes only the page the first decode query sees, never the prompt's 3.
    assert reservation.group_page_ids == ((0, 1, 2), (HOLE, HOLE, 3), (HOLE, HOLE, 4))
    assert reservation.num_cached_blocks == 0
    assert [manager.stats.peak_blocks_in_use for manager in generation.kv_cache.managers[1:]] == [1, 1]
    generation.check_integrity()
    moved = pull_pages(context, generation, prefill, reservation)
    layer_page = context.page_bytes  # one page: one layer (the groups' size)
    assert moved == (3 + 1 + 1) * layer_page
    all_full = 3 * make_engine(directory, False).page_bytes  # 3 pages of every layer: the one-group layout
    assert moved / all_full == pytest.approx((3 * 1 + 1 * 2) / (3 * 3))
    context.release_prefill("r")
    assert context.num_blocks_in_use() == 0
    generation.add_prefilled_request(
        reservation, prompt, params, prefill.candidate_ids, prefill.candidate_logprobs
    )
    outputs = {}
    while generation.has_unfinished():
        outputs |= {output.request_id: output for output in generation.step() if output.finished}
        generation.check_integrity()
    beams = [(beam.token_ids, beam.score) for beam in outputs["r"].beams]
    assert beams == [(beam.token_ids, beam.score) for beam in aggregated.beams]
    assert generation.num_blocks_in_use() == 0


def test_a_reused_prefix_is_not_pulled_again(checkpoints: dict[str, Path]) -> None:
    """A generation engine that already holds the first 32 tokens (its own earlier request) pulls
    only the blocks after them, in each group the ones its window still needs."""
    directory = checkpoints["gemma3"]
    generation = make_engine(directory)
    first = list(range(5, 41))
    generation.generate(first, SamplingParams(max_new_tokens=2, ignore_eos=True))
    prompt = first[:32] + list(range(60, 80))  # 52 tokens: blocks 0..3, first query at 52
    reservation = generation.reserve_prompt("r", prompt, params=SamplingParams(max_new_tokens=4))
    assert reservation.num_cached_blocks == 2
    assert [len(ids) for ids in reservation.group_page_ids] == [4, 4, 4]
    # The query at 52 sees keys 45..52: each sliding group holds blocks 2 and 3 only.
    for sliding_ids in reservation.group_page_ids[1:]:
        assert sliding_ids[:2] == (HOLE, HOLE) and HOLE not in sliding_ids[2:]
    src = ((0, 1, 2, 3), (HOLE, HOLE, 6, 7), (HOLE, HOLE, 10, 11))
    pairs = pages_to_pull(src, reservation.group_page_ids, reservation.num_cached_blocks)
    assert [len(src_ids) for src_ids, _ in pairs] == [2, 2, 2]
    generation.cancel_reservation("r")
    generation.check_integrity()
    assert generation.num_blocks_in_use() == 0


def serve_disaggregated(
    context: LLMEngine, generation: LLMEngine, request_id: str, prompt: list[int]
) -> None:
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    prefill = context.prefill(request_id, prompt, params.num_candidates)
    reservation = generation.reserve_prompt(request_id, prompt, params=params)
    pull_pages(context, generation, prefill, reservation)
    context.release_prefill(request_id)
    generation.add_prefilled_request(
        reservation, prompt, params, prefill.candidate_ids, prefill.candidate_logprobs
    )
    while generation.has_unfinished():
        generation.step()
        generation.check_integrity()


def test_reuse_needs_only_the_window_and_reports_what_full_layers_could_reuse(
    checkpoints: dict[str, Path],
) -> None:
    """A generation engine that received a 48-token prompt holds its 3 full-group blocks and, in
    the sliding group, block 2 only (the query at 48 sees keys 41..48): blocks 0 and 1 were never
    pulled there, so they are not in its sliding tree."""
    directory = checkpoints["gemma3"]
    context, generation = make_engine(directory), make_engine(directory)
    first = list(range(3, 51))  # 48 tokens, 3 whole blocks
    serve_disaggregated(context, generation, "first", first)
    # The same 48 tokens and more: 3 blocks, the window of the query at 48 needs block 2 only, which
    # the sliding group holds: all 48 reused though its blocks 0 and 1 are gone (the two agree).
    longer = first + list(range(60, 68))
    plan = generation.kv_cache.plan_reuse(longer)
    assert (plan.num_blocks, plan.full_attention_tokens, plan.window_tokens) == (3, 48, 48)
    # A prompt sharing 40 tokens: the full group could reuse blocks 0 and 1 (32 tokens), but the
    # window of the query at 32 needs block 1 (and at 16 block 0), which the sliding group lacks.
    diverging = first[:40] + list(range(70, 80))
    plan = generation.kv_cache.plan_reuse(diverging)
    assert (plan.num_blocks, plan.full_attention_tokens, plan.window_tokens) == (0, 32, 0)
    pruned_before = generation.counters().window_pruned_tokens
    outputs = {}
    for request_id, prompt in (("longer", longer), ("diverging", diverging)):
        generation.add_request(request_id, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        while generation.has_unfinished():
            outputs |= {output.request_id: output for output in generation.step() if output.finished}
            generation.check_integrity()
    stats = {request_id: outputs[request_id].stats for request_id in outputs}
    assert (stats["longer"]["reused_tokens"], stats["longer"]["full_attention_reusable_tokens"]) == (48, 48)
    assert stats["longer"]["window_reusable_tokens"] == 48
    assert (stats["diverging"]["reused_tokens"], stats["diverging"]["full_attention_reusable_tokens"]) == (
        0,
        32,
    )
    assert stats["diverging"]["window_reusable_tokens"] == 0
    assert generation.counters().window_pruned_tokens - pruned_before == 32
    counters = generation.counters()
    assert counters.group_names == ("full", "window8") and counters.group_blocks_in_use == (0, 0)


def test_context_side_prompts_take_their_chunks_room_up_front(checkpoints: dict[str, Path]) -> None:
    """Prefill-only prompts of 100 tokens in chunks of 16, in a shared pool of 48 one-layer pages
    (the bytes of 16 all-full pages): each takes its 7 full-group pages up front and may hold 3
    pages per sliding group at once, 13 in all. Three fit (21 held, 18 promised); a fourth is
    refused while they are in their chunks (nothing held), never admitted to stall part-way;
    once they are pinned (7 + 2 window pages per group, 11 each) it fits."""
    directory = checkpoints["gemma3"]
    page_bytes = make_engine(directory, False).page_bytes
    cache = CacheConfig(T, 1, max_pool_bytes=16 * page_bytes, is_sized_by_memory=True)
    config = EngineConfig(
        model=str(directory), dtype="float64", cache=cache, max_num_seqs=8, max_num_batched_tokens=16
    )
    engine = LLMEngine(config)
    assert engine.kv_cache.num_blocks() == 48
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 90, (100,), generator=generator).tolist() for _ in range(4)]
    for index in range(3):
        engine.add_prefill(f"p{index}", prompts[index], 4)
    held = engine.kv_cache.num_group_blocks_in_use()
    assert held == (21, 0, 0)
    with pytest.raises(OutOfBlocksError, match="promised"):
        engine.add_prefill("p3", prompts[3], 4)
    assert engine.kv_cache.num_group_blocks_in_use() == held
    engine.check_integrity()
    done = set()
    while len(done) < 3:
        for output in engine.step():
            assert output.error is None and output.prefill is not None
            done.add(output.request_id)
        engine.check_integrity()
        assert max(engine.kv_cache.num_group_blocks_in_use()[1:]) <= 9
    assert engine.kv_cache.num_group_blocks_in_use() == (3 * 7, 3 * 2, 3 * 2)  # pinned: the window only
    engine.add_prefill("p3", prompts[3], 4)
    engine.check_integrity()
    for index in range(3):
        engine.release_prefill(f"p{index}")
    engine.abort("p3")
    engine.check_integrity()
    assert engine.num_blocks_in_use() == 0
    # A prompt whose groups together need more than the whole pool never fits: 400 tokens take
    # 25 full pages and up to 3 in each window group, 31 of a 30-page pool.
    small = LLMEngine(replace(config, cache=CacheConfig(T, 30)))
    with pytest.raises(
        PoolTooSmallError, match=r"\[25, 3, 3\] blocks for its prompt, more than the pool's 30"
    ):
        small.add_prefill("long", prompts[0] * 4, 4)
    assert small.num_blocks_in_use() == 0


def test_eviction_in_a_small_pool_keeps_the_beams_exact(checkpoints: dict[str, Path]) -> None:
    """A shared pool of 22 pages, five 60-token prompts one after the other, the third and fifth
    sharing 48 tokens with the first and second: cached pages are evicted from the tree of the
    group that published them (the sliding groups', released as soon as they leave the window,
    too), reuse finds what is left, and every request's beams equal an all-full engine's whose
    pool of 48 blocks evicts nothing; check_integrity after every step."""
    directory = checkpoints["gemma3"]
    cache = CacheConfig(tokens_per_block=T, num_blocks=22)
    engine = LLMEngine(EngineConfig(model=str(directory), dtype="float64", cache=cache))
    evictions = [0] * len(engine.kv_cache.managers)
    callbacks = engine.kv_cache.allocator._evict_callbacks
    for group, manager in enumerate(engine.kv_cache.managers):

        def counting(block_id: int, evict=callbacks[manager.owner], group: int = group) -> None:  # type: ignore[no-untyped-def]
            evictions[group] += 1
            evict(block_id)

        callbacks[manager.owner] = counting
    generator = torch.Generator().manual_seed(11)
    first, second, fourth = (torch.randint(3, 90, (60,), generator=generator).tolist() for _ in range(3))
    tails = [torch.randint(3, 90, (12,), generator=generator).tolist() for _ in range(2)]
    prompts = [first, second, first[:48] + tails[0], fourth, second[:48] + tails[1]]
    params = SamplingParams(beam_width=2, max_new_tokens=4, ignore_eos=True)
    reference = make_engine(directory, False)
    for prompt in prompts:
        beams, _ = run_recording_blocks(engine, prompt, params)
        expected, _ = run_recording_blocks(reference, prompt, params)
        assert [(beam.token_ids, beam.score) for beam in beams] == [
            (beam.token_ids, beam.score) for beam in expected
        ]
    assert all(evictions), evictions  # every group's tree lost cached pages to eviction
    assert engine.kv_cache.stats.reused_tokens > 0  # and a later prompt still reused a prefix
