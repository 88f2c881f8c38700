"""Scoring in the engine: every prompt position's log-prob and each returned token's equal
transformers' log_softmax of the same forward pass (float64 to 1e-9, float32 to 1e-4), in one
chunk or many, with a cached prefix in the pool, for greedy, sampling and each beam."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from engine.logprobs import LogprobTrie
from engine.types import RequestOutput, TokenLogprob
from tests.helpers.checkpoints import write_random_lfm2_checkpoint, write_random_llama_checkpoint

TOLERANCES = {"float64": 1e-9, "float32": 1e-4}
NUM_TOP = 3


@pytest.fixture(autouse=True)
def few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama_checkpoint(tmp_path_factory.mktemp("llama"), seed=3)


def reference_logprobs(model_dir: Path, dtype: str, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] transformers' log_softmax of one forward pass over token_ids."""
    from transformers import LlamaForCausalLM

    torch_dtype = torch.float64 if dtype == "float64" else torch.float32
    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([token_ids])).logits[0]  # [P, V]
    return torch.log_softmax(logits, dim=-1)


def make_engine(model_dir: Path, dtype: str, max_num_batched_tokens: int = 512) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            cache=CacheConfig(tokens_per_block=16, num_blocks=64),
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )


def check_position(record: TokenLogprob, row: torch.Tensor, token_id: int, tolerance: float) -> None:
    """record against the reference row [V] of the position before token_id."""
    assert record.token_id == token_id
    assert abs(record.logprob - float(row[token_id])) <= tolerance
    expected_ids = torch.topk(row, k=len(record.top)).indices.tolist()
    assert [token for token, _ in record.top] == expected_ids
    for token, logprob in record.top:
        assert abs(logprob - float(row[token])) <= tolerance


def prompt(length: int) -> list[int]:
    return [(7 * index + 3) % 90 + 3 for index in range(length)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("chunk_tokens", [512, 16])  # one pass, or chunks of 16 (chunked prefill)
def test_prompt_logprobs_match_transformers(checkpoint: Path, dtype: str, chunk_tokens: int) -> None:
    engine = make_engine(checkpoint, dtype, chunk_tokens)
    prompt_ids = prompt(45)
    reference = reference_logprobs(checkpoint, dtype, prompt_ids)
    # A request that fills the prefix cache with the same prompt's blocks first: the scored
    # request must not take them (their positions have no logits) and must give the same numbers.
    engine.generate(prompt_ids, SamplingParams(max_new_tokens=1))
    engine.check_integrity()
    for _ in range(2):  # the second run finds its own blocks published by the first
        output = engine.generate(prompt_ids, SamplingParams(max_new_tokens=2, prompt_logprobs=NUM_TOP))
        engine.check_integrity()
        assert output.stats["reused_tokens"] == 0
        scores = output.prompt_logprobs
        assert scores is not None and len(scores) == len(prompt_ids) and scores[0] is None
        for position in range(1, len(prompt_ids)):
            record = scores[position]
            assert record is not None and len(record.top) == NUM_TOP
            check_position(record, reference[position - 1], prompt_ids[position], TOLERANCES[dtype])
    # Without prompt_logprobs the prefix is reused as before, and nothing is scored.
    plain = engine.generate(prompt_ids, SamplingParams(max_new_tokens=1))
    assert plain.stats["reused_tokens"] == 32 and plain.prompt_logprobs is None
    engine.check_integrity()


def test_a_float32_prefill_ships_its_candidates_once(checkpoint: Path) -> None:
    """float32: the decoder's candidates are the reported values; the handoff needs no copy."""
    engine = make_engine(checkpoint, "float32")
    result = engine.prefill("ctx", prompt(20), 4)
    assert len(result.candidate_logprobs) == 4 and result.candidate_model_logprobs == []
    engine.release_prefill("ctx")
    engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_context_side_prefill_scores_equal_the_aggregated_ones(checkpoint: Path, dtype: str) -> None:
    engine = make_engine(checkpoint, dtype, 16)
    prompt_ids = prompt(40)
    aggregated = engine.generate(prompt_ids, SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    result = engine.prefill("ctx", prompt_ids, 1, prompt_logprobs=2)
    engine.check_integrity()
    assert result.prompt_logprobs is not None and aggregated.prompt_logprobs is not None
    assert [None, *result.prompt_logprobs] == aggregated.prompt_logprobs
    engine.release_prefill("ctx")
    engine.check_integrity()


def replay_generated(
    checkpoint: Path, dtype: str, prompt_ids: list[int], records: list[TokenLogprob], tolerance: float
) -> None:
    """Each generated token's record against the reference row of the sequence before it."""
    token_ids = [record.token_id for record in records]
    reference = reference_logprobs(checkpoint, dtype, prompt_ids + token_ids)
    for index, record in enumerate(records):
        check_position(record, reference[len(prompt_ids) + index - 1], record.token_id, tolerance)


GENERATED_CASES = [
    SamplingParams(max_new_tokens=5, logprobs=4, ignore_eos=True),
    SamplingParams(max_new_tokens=5, logprobs=0, temperature=1.3, top_k=20, seed=7, ignore_eos=True),
    SamplingParams(max_new_tokens=5, logprobs=2, beam_width=3, ignore_eos=True),
]


def follow(engine: LLMEngine) -> RequestOutput:
    """Steps the engine to its one request's end; the final output's beams get, as `logprobs` of
    a one-sequence request, the records its progress outputs streamed (new_logprobs)."""
    streamed: list[TokenLogprob] = []
    while True:
        for step_output in engine.step():
            engine.check_integrity()  # the live request's trie too
            if not step_output.finished:
                assert len(step_output.new_logprobs) in (0, len(step_output.new_token_ids[0]))
                streamed.extend(step_output.new_logprobs)
                continue
            if step_output.beams[0].logprobs is None or len(step_output.beams) > 1:
                assert not streamed
                return step_output
            # What was streamed is the final records' prefix: the last step's come with the end.
            final = step_output.beams[0].logprobs
            assert streamed == final[: len(streamed)] and len(final) - len(streamed) <= 1
            return step_output


def run_aggregated(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
    engine.add_request(f"scored-{id(params)}-{engine.counters().prompt_tokens}", prompt_ids, params)
    return follow(engine)


def run_disaggregated(
    context: LLMEngine, generation: LLMEngine, prompt_ids: list[int], params: SamplingParams
) -> RequestOutput:
    """The context engine prefills; its pages are copied into the generation engine's reservation
    (what a UCX pull does); the handoff's candidates go over as the workers ship them."""
    request_id = f"pulled-{context.counters().prompt_tokens}"
    prefilled = context.prefill(request_id, prompt_ids, max(params.num_candidates, params.logprobs or 0))
    reservation = generation.reserve_prompt(request_id, prompt_ids, params=params)
    held = prefilled.block_ids[reservation.num_cached_blocks :]  # the pages a pull would take
    generation.kv_pool.data[reservation.missing_block_ids] = context.kv_pool.data[held]
    context.release_prefill(request_id)
    context.check_integrity()
    # float64: the first token's records travel beside the decoder's float32 candidates.
    assert len(prefilled.candidate_model_logprobs) == len(prefilled.candidate_ids)
    assert prefilled.candidate_model_logprobs != prefilled.candidate_logprobs
    generation.add_prefilled_request(
        reservation, prompt_ids, params, prefilled.candidate_ids, prefilled.candidate_logprobs,
        candidate_model_logprobs=prefilled.candidate_model_logprobs,
    )  # fmt: skip
    return follow(generation)


@pytest.mark.parametrize("deployment", ["aggregated", "disaggregated"])
@pytest.mark.parametrize("cached_prefix", [False, True], ids=["cold", "cached-prefix"])
@pytest.mark.parametrize("params", GENERATED_CASES, ids=["greedy", "sampling", "beam-3"])
def test_generated_logprobs_are_the_model_distribution(
    checkpoint: Path, params: SamplingParams, deployment: str, cached_prefix: bool
) -> None:
    """float64: every returned token's log-prob (and its top k) equals transformers' log_softmax
    of the same pass to 1e-9, whichever side computed it and whatever the prefix cache held; the
    tokens and beam scores are those of the same request without logprobs."""
    engines = [make_engine(checkpoint, "float64")]
    if deployment == "disaggregated":
        engines.append(make_engine(checkpoint, "float64"))
    prompt_ids = prompt(40)

    def run(run_params: SamplingParams) -> RequestOutput:
        if deployment == "aggregated":
            return run_aggregated(engines[0], prompt_ids, run_params)
        return run_disaggregated(engines[0], engines[1], prompt_ids, run_params)

    if cached_prefix:  # the prompt's first 32 tokens (two blocks) are in every pool's tree
        run(SamplingParams(max_new_tokens=1))
    output = run(params)
    assert output.stats["reused_tokens"] == (32 if cached_prefix else 0)
    plain = run(replace(params, logprobs=None))
    for engine in engines:
        engine.check_integrity()
    assert len(output.beams) == params.beam_width
    # Scoring changes no decision and no score: the decoders still run on their float32 rows.
    assert [(beam.token_ids, beam.cumulative_logprob, beam.score) for beam in output.beams] == [
        (beam.token_ids, beam.cumulative_logprob, beam.score) for beam in plain.beams
    ]
    for beam in output.beams:
        assert beam.logprobs is not None and len(beam.logprobs) == len(beam.token_ids)
        assert [record.token_id for record in beam.logprobs] == beam.token_ids
        assert all(len(record.top) == params.logprobs for record in beam.logprobs)
        # The decoders sum float32 rows; the records are the float64 rows' values.
        assert math.isclose(
            sum(record.logprob for record in beam.logprobs), beam.cumulative_logprob, abs_tol=1e-4
        )
        replay_generated(checkpoint, "float64", prompt_ids, beam.logprobs, TOLERANCES["float64"])


def test_hybrid_prompt_logprobs_match_transformers(tmp_path: Path) -> None:
    """LFM2 (convolution state + attention): chunked, with its prefix and snapshots cached."""
    from transformers import Lfm2ForCausalLM

    model_dir = write_random_lfm2_checkpoint(tmp_path / "lfm2", seed=4)
    engine = make_engine(model_dir, "float64", 16)
    prompt_ids = prompt(37)
    reference_model = Lfm2ForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        reference = torch.log_softmax(reference_model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    engine.generate(prompt_ids, SamplingParams(max_new_tokens=1))
    output = engine.generate(prompt_ids, SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    engine.check_integrity()
    assert output.prompt_logprobs is not None and output.stats["reused_tokens"] == 0
    for position in range(1, len(prompt_ids)):
        record = output.prompt_logprobs[position]
        assert record is not None
        check_position(record, reference[position - 1], prompt_ids[position], TOLERANCES["float64"])


def test_trie_walks_a_finished_beam_and_checks_itself() -> None:
    trie = LogprobTrie(num_top=1)
    trie.record_candidates([5, 6], [-0.1, -2.0])
    trie.advance([0, 0], [5, 6], None)  # two running beams
    rows = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]]), dim=-1)
    model_rows = rows.double() - 1e-3  # ranks come from `rows`, values from these
    trie.record_rows(rows, model_rows, 2)
    trie.advance([1], [0], None)  # beam 1 goes on; beam 0's best (token 1) finished there
    trie.check_integrity()
    finished = trie.walk([5, 1])
    assert [record.token_id for record in finished] == [5, 1]
    assert finished[0].top == ((5, -0.1),) and finished[1].top[0][0] == 1
    assert finished[1].logprob == float(model_rows[0, 1]) == finished[1].top[0][1]
    assert math.isnan(trie.walk([7])[0].logprob)  # never a candidate
    assert trie.take_streamed([[5], [6]]) == []  # beams stream no records: they may reorder
    assert trie.take_streamed([[5]]) == finished[:1] and trie.take_streamed([[1]]) == finished[1:]
    trie.running = [trie.num_nodes]
    with pytest.raises(AssertionError):
        trie.check_integrity()
