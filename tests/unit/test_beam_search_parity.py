"""Beam search parity with transformers' `generate`, float64, on random tiny Llama checkpoints.

Every listed value is covered (prompt lengths 1, 31, 32, 33, 64, 67; widths 1-4; length penalty
below, at and above 1; early stopping True, False and "never"; no eos, and an eos the reference
actually produces) without the full cross product: case i takes value i mod n of each axis, with
the axes' lengths coprime enough that the combinations vary. Width 1 is greedy search on both
sides (transformers reports no sequence score for it; the token log-probs are compared instead).

Each case checks: every beam's tokens equal, scores within 1e-6, the finish reasons, and the
pool back to zero blocks in use.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from tests.helpers.checkpoints import write_random_llama_checkpoint
from tests.helpers.hf_reference import assert_engine_beams_equal, reference_case

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (1, 31, 32, 33, 64, 67)
BEAM_WIDTHS = (1, 2, 3, 4)
LENGTH_PENALTIES = (0.5, 1.0, 2.0)
EARLY_STOPPING: tuple[bool | str, ...] = (True, False, "never")
# name -> (num_heads, num_kv_heads, tie_word_embeddings)
CHECKPOINT_KINDS = {
    "gqa_untied": (4, 2, False),
    "mha_tied": (4, 4, True),
    "gqa_tied": (4, 1, True),
    "mha_untied": (2, 2, False),
}
NUM_CASES = 48
MAX_NEW_TOKENS = 10
SCORE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Case:
    kind: str
    prompt_len: int
    beam_width: int
    length_penalty: float
    early_stopping: bool | str
    tokens_per_block: int

    @property
    def name(self) -> str:
        return (
            f"{self.kind}-P{self.prompt_len}-W{self.beam_width}-lp{self.length_penalty}"
            f"-es{self.early_stopping}-T{self.tokens_per_block}"
        )


def build_cases() -> list[Case]:
    kinds = list(CHECKPOINT_KINDS)
    return [
        Case(
            kind=kinds[index % len(kinds)],
            prompt_len=PROMPT_LENS[index % len(PROMPT_LENS)],
            beam_width=BEAM_WIDTHS[(index // 2) % len(BEAM_WIDTHS)],
            length_penalty=LENGTH_PENALTIES[index % len(LENGTH_PENALTIES)],
            early_stopping=EARLY_STOPPING[(index // 3) % len(EARLY_STOPPING)],
            tokens_per_block=(32, 16)[(index // 4) % 2],
        )
        for index in range(NUM_CASES)
    ]


CASES = build_cases()


@dataclass
class Reference:
    model: torch.nn.Module
    engines: dict[int, LLMEngine]  # by tokens_per_block
    vocab_size: int


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Reference]]:
    torch.set_num_threads(1)
    result = {}
    for seed, (kind, (num_heads, num_kv_heads, tied)) in enumerate(CHECKPOINT_KINDS.items()):
        directory: Path = tmp_path_factory.mktemp(kind)
        write_random_llama_checkpoint(
            directory, num_heads=num_heads, num_kv_heads=num_kv_heads, tie_word_embeddings=tied, seed=seed
        )
        model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
        engines = {
            size: LLMEngine(
                EngineConfig(
                    model=str(directory),
                    dtype="float64",
                    cache=CacheConfig(tokens_per_block=size, num_blocks=128),
                )
            )
            for size in (16, 32)
        }
        result[kind] = Reference(model, engines, model.config.vocab_size)
    yield result


@pytest.mark.parametrize("with_eos", [False, True], ids=["no_eos", "eos"])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_beams_match_transformers(
    references: dict[str, Reference], case: Case, with_eos: bool, record_property: pytest.RecordProperty
) -> None:
    reference = references[case.kind]
    generator = torch.Generator().manual_seed(case.prompt_len * 31 + case.beam_width)
    prompt = torch.randint(3, reference.vocab_size, (case.prompt_len,), generator=generator).tolist()
    engine = reference.engines[case.tokens_per_block]
    params = SamplingParams(
        beam_width=case.beam_width,
        max_new_tokens=MAX_NEW_TOKENS,
        length_penalty=case.length_penalty,
        early_stopping=case.early_stopping,
    )
    expected, eos_token_id = reference_case(reference.model, prompt, params, with_eos)
    params = replace(params, eos_token_id=eos_token_id, ignore_eos=eos_token_id is None)
    output = assert_engine_beams_equal(engine, prompt, params, expected, SCORE_TOLERANCE)
    for index, beam in enumerate(output.beams):
        normalised = beam.cumulative_logprob / len(beam.token_ids) ** case.length_penalty
        assert math.isclose(normalised, beam.score, rel_tol=1e-6), f"beam {index}"
    num_stopped = sum(stopped for _, _, stopped in expected)
    record_property("beams_compared", case.beam_width)
    record_property("beams_stopped_on_eos", num_stopped)
    print(f"{case.name} eos={eos_token_id}: {case.beam_width} beams equal, {num_stopped} stopped on eos")


def test_cases_cover_every_listed_value() -> None:
    assert {case.prompt_len for case in CASES} == set(PROMPT_LENS)
    assert {case.beam_width for case in CASES} == set(BEAM_WIDTHS)
    assert {case.length_penalty for case in CASES} == set(LENGTH_PENALTIES)
    assert {case.early_stopping for case in CASES} == set(EARLY_STOPPING)
    assert {case.kind for case in CASES} == set(CHECKPOINT_KINDS)
    beam_cases = [case for case in CASES if case.beam_width > 1]
    assert {case.early_stopping for case in beam_cases} == set(EARLY_STOPPING)
    assert {case.length_penalty for case in beam_cases} == set(LENGTH_PENALTIES)
