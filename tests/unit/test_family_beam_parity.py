"""Beam search parity with transformers' `generate` for every family, float64, through LLMEngine.

Per family a few cases, each taking value i mod n of every axis (as test_beam_search_parity.py
does for Llama): prompts shorter than, at and past the sliding window of 8 and around the block
boundaries; widths 1 to 4; length penalties 0.5, 1 and 2; early stopping True, False and "never";
blocks 16 and 32; odd cases with an eos the reference actually produces. With 10 new tokens every
decode also runs past the window. Checks: every beam's tokens, scores within 1e-6, the finish
reasons, the cache's integrity and the pool back to zero blocks in use.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from tests.helpers.family_checkpoints import load_reference, write_family_checkpoint
from tests.helpers.hf_reference import assert_engine_beams_equal, reference_case

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "phi3")
PROMPT_LENS = (3, 8, 9, 15, 16, 17, 32, 33)
BEAM_WIDTHS = (1, 2, 3, 4)
LENGTH_PENALTIES = (0.5, 1.0, 2.0)
EARLY_STOPPING: tuple[bool | str, ...] = (True, False, "never")
CASES_PER_FAMILY = 6
MAX_NEW_TOKENS = 10
SCORE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Case:
    family: str
    prompt_len: int
    beam_width: int
    length_penalty: float
    early_stopping: bool | str
    tokens_per_block: int
    with_eos: bool

    @property
    def name(self) -> str:
        return (
            f"{self.family}-P{self.prompt_len}-W{self.beam_width}-lp{self.length_penalty}"
            f"-es{self.early_stopping}-T{self.tokens_per_block}-{'eos' if self.with_eos else 'noeos'}"
        )


def build_cases() -> list[Case]:
    cases = []
    for family_index, family in enumerate(FAMILIES):
        for local in range(CASES_PER_FAMILY):
            index = family_index + local * len(FAMILIES)  # the families share out the combinations
            cases.append(
                Case(
                    family=family,
                    prompt_len=PROMPT_LENS[index % len(PROMPT_LENS)],
                    beam_width=BEAM_WIDTHS[(local + family_index) % len(BEAM_WIDTHS)],
                    length_penalty=LENGTH_PENALTIES[index % len(LENGTH_PENALTIES)],
                    early_stopping=EARLY_STOPPING[(index // 2) % len(EARLY_STOPPING)],
                    tokens_per_block=(16, 32)[local % 2],
                    with_eos=local % 3 == 1,
                )
            )
    return cases


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
    for seed, family in enumerate(FAMILIES):
        directory: Path = write_family_checkpoint(tmp_path_factory.mktemp(family), family, seed=seed + 20)
        model = load_reference(family, directory, torch.float64)
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
        result[family] = Reference(model, engines, model.config.vocab_size)
    yield result


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_family_beams_match_transformers(references: dict[str, Reference], case: Case) -> None:
    reference = references[case.family]
    generator = torch.Generator().manual_seed(case.prompt_len * 31 + case.beam_width)
    prompt = torch.randint(3, reference.vocab_size, (case.prompt_len,), generator=generator).tolist()
    engine = reference.engines[case.tokens_per_block]
    params = SamplingParams(
        beam_width=case.beam_width,
        max_new_tokens=MAX_NEW_TOKENS,
        length_penalty=case.length_penalty,
        early_stopping=case.early_stopping,
    )
    expected, eos_token_id = reference_case(reference.model, prompt, params, case.with_eos)
    params = replace(params, eos_token_id=eos_token_id, ignore_eos=eos_token_id is None)
    assert_engine_beams_equal(engine, prompt, params, expected, SCORE_TOLERANCE)
    num_stopped = sum(stopped for _, _, stopped in expected)
    print(f"{case.name} eos={eos_token_id}: {case.beam_width} beams equal, {num_stopped} stopped on eos")


def test_cases_cover_every_listed_value_per_family() -> None:
    for family in FAMILIES:
        cases = [case for case in CASES if case.family == family]
        assert {case.beam_width for case in cases} == set(BEAM_WIDTHS), family
        assert {case.tokens_per_block for case in cases} == {16, 32}, family
        assert any(case.with_eos for case in cases) and not all(case.with_eos for case in cases), family
        assert any(case.prompt_len > 8 for case in cases) and any(case.prompt_len <= 8 for case in cases), (
            family
        )
    assert {case.prompt_len for case in CASES} == set(PROMPT_LENS)
    assert {case.length_penalty for case in CASES} == set(LENGTH_PENALTIES)
    assert {case.early_stopping for case in CASES if case.beam_width > 1} == set(EARLY_STOPPING)
