"""The engine's counters for server metrics: queue depth, pool, prefix reuse and beam-tail copies,
exact for a tiny model with block 16."""

from __future__ import annotations

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

TOKENS_PER_BLOCK = 16


def make_engine(max_num_seqs: int) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=64)
    return LLMEngine(EngineConfig(dtype="float64", cache=cache, max_num_seqs=max_num_seqs))


def run_until_done(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()


def test_counters_follow_queue_pool_reuse_and_beam_copies() -> None:
    engine = make_engine(max_num_seqs=4)
    prompt = [(3 + 7 * index) % 250 for index in range(35)]  # 2 full blocks + 3 tokens
    params = SamplingParams(beam_width=4, max_new_tokens=3)
    counters = engine.counters()
    assert (counters.num_blocks_total, counters.num_blocks_in_use, counters.num_blocks_cached) == (64, 0, 0)

    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)  # 4 beams each, 4 sequences at most: b waits for a
    counters = engine.counters()
    assert (counters.num_waiting_requests, counters.num_running_requests) == (2, 0)
    engine.step()
    counters = engine.counters()
    assert (counters.num_waiting_requests, counters.num_running_requests) == (1, 1)
    assert counters.prompt_tokens == 35 and counters.reused_tokens == 0

    run_until_done(engine)
    counters = engine.counters()
    # b found a's two full blocks (lookups use prompt[:-1]: 34 tokens, 2 whole blocks).
    assert (counters.prompt_tokens, counters.reused_tokens) == (70, 32)
    # Each request's expansion to 4 beams copies the 3-token tail 3 times; later forks copy more.
    assert counters.beam_tail_copies >= 6
    assert counters.partial_reuse_copies == 0
    assert counters.num_blocks_in_use == 0 and counters.num_blocks_cached >= 2
    assert (counters.num_waiting_requests, counters.num_running_requests) == (0, 0)


def test_a_refused_admission_does_not_count_its_lookup() -> None:
    cache = CacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_blocks=4)
    engine = LLMEngine(EngineConfig(dtype="float64", cache=cache))
    engine.add_request("big", list(range(40)), SamplingParams(beam_width=1, max_new_tokens=20))
    engine.add_request("next", list(range(100, 120)), SamplingParams(beam_width=1, max_new_tokens=8))
    engine.step()  # "big" takes the pool's bound; "next" is tried and put back
    assert engine.counters().prompt_tokens == 40
    run_until_done(engine)
    assert engine.counters().prompt_tokens == 60
