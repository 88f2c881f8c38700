"""Beam search parity with transformers' `generate`, float64, on random tiny LFM2 checkpoints.

LFM2 is a hybrid: short-convolution layers (a recurrent state of the last K-1 inputs per layer)
between attention layers. Cases cover beam widths 1 to 4, prompts that are and are not
block-aligned (block 16 and 32), two layer layouts (convolution first; attention first with
kernel 4, convolution biases, untied embeddings and the adjusted feed-forward width), and prefix
reuse: a second request sharing a prefix resumes from a snapshot and gives the beams of a fresh
engine and of the reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.types import RequestOutput
from tests.helpers.checkpoints import write_random_lfm2_checkpoint
from tests.helpers.hf_reference import ReferenceBeam, reference_beams

transformers = pytest.importorskip("transformers")

CHECKPOINT_KINDS: dict[str, dict[str, object]] = {
    "conv_first": {},
    "attention_first_k4_bias": {
        "layer_types": ("full_attention", "conv", "conv", "full_attention"),
        "conv_kernel_size": 4,
        "conv_bias": True,
        "tie_word_embeddings": False,
        "auto_adjust_ff_dim": True,
    },
}
# (kind, prompt_len, beam_width, tokens_per_block, length_penalty, early_stopping)
CASES = [
    ("conv_first", 1, 1, 16, 1.0, False),
    ("conv_first", 15, 2, 16, 1.0, False),
    ("conv_first", 16, 3, 16, 0.5, True),
    ("conv_first", 33, 4, 32, 2.0, "never"),
    ("conv_first", 64, 2, 32, 1.0, False),
    ("conv_first", 47, 1, 16, 1.0, False),
    ("attention_first_k4_bias", 2, 4, 16, 1.0, False),
    ("attention_first_k4_bias", 31, 3, 32, 1.0, True),
    ("attention_first_k4_bias", 32, 2, 32, 2.0, False),
    ("attention_first_k4_bias", 48, 1, 16, 1.0, False),
    ("attention_first_k4_bias", 67, 4, 16, 0.5, "never"),
]
MAX_NEW_TOKENS = 8
SCORE_TOLERANCE = 1e-6


@dataclass
class Reference:
    directory: Path
    model: torch.nn.Module
    engines: dict[int, LLMEngine]  # by tokens_per_block
    vocab_size: int


def make_engine(directory: Path, tokens_per_block: int, enable_partial_reuse: bool = False) -> LLMEngine:
    cache = CacheConfig(
        tokens_per_block=tokens_per_block, num_blocks=64, enable_partial_reuse=enable_partial_reuse
    )
    return LLMEngine(EngineConfig(model=str(directory), dtype="float64", cache=cache, max_num_seqs=8))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Reference]]:
    torch.set_num_threads(1)
    result = {}
    for seed, (kind, options) in enumerate(CHECKPOINT_KINDS.items()):
        directory = write_random_lfm2_checkpoint(tmp_path_factory.mktemp(kind), seed=seed, **options)  # type: ignore[arg-type]
        model = transformers.Lfm2ForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
        engines = {size: make_engine(directory, size) for size in (16, 32)}
        result[kind] = Reference(directory, model, engines, model.config.vocab_size)
    yield result


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def params_for(
    beam_width: int, length_penalty: float = 1.0, early_stopping: bool | str = False
) -> SamplingParams:
    return SamplingParams(
        beam_width=beam_width,
        max_new_tokens=MAX_NEW_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        ignore_eos=True,
    )


def assert_same_beams(output: RequestOutput, expected: list[ReferenceBeam]) -> None:
    assert len(output.beams) == len(expected)
    for index, (beam, (tokens, score, _)) in enumerate(zip(output.beams, expected, strict=True)):
        assert beam.token_ids == tokens, f"beam {index}"
        assert math.isclose(beam.score, score, rel_tol=0.0, abs_tol=SCORE_TOLERANCE), f"beam {index}"


def run_checked(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """Like engine.generate, with check_integrity after every step."""
    request_id = f"r{len(prompt)}-{params.beam_width}-{id(prompt)}"
    engine.add_request(request_id, prompt, params)
    while True:
        outputs = engine.step()
        engine.check_integrity()
        for output in outputs:
            if output.request_id == request_id and output.finished:
                assert output.error is None, output.error
                return output


@pytest.mark.parametrize(
    ("kind", "prompt_len", "beam_width", "tokens_per_block", "length_penalty", "early_stopping"),
    CASES,
    ids=[f"{c[0]}-P{c[1]}-W{c[2]}-T{c[3]}-lp{c[4]}-es{c[5]}" for c in CASES],
)
def test_beams_match_transformers(
    references: dict[str, Reference],
    kind: str,
    prompt_len: int,
    beam_width: int,
    tokens_per_block: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> None:
    reference = references[kind]
    prompt = random_prompt(reference.vocab_size, prompt_len, prompt_len * 31 + beam_width)
    expected = reference_beams(
        reference.model, prompt, beam_width, MAX_NEW_TOKENS, length_penalty, early_stopping, None
    )
    engine = reference.engines[tokens_per_block]
    output = run_checked(engine, prompt, params_for(beam_width, length_penalty, early_stopping))
    assert_same_beams(output, expected)
    assert engine.num_blocks_in_use() == 0
    assert engine.state_pool is not None and engine.state_pool.num_free_slots() == engine.state_pool.num_slots


@pytest.mark.parametrize("enable_partial_reuse", [False, True], ids=["reuse_off", "reuse_on"])
def test_prefix_reuse_gives_the_beams_of_a_fresh_engine(
    references: dict[str, Reference], enable_partial_reuse: bool
) -> None:
    """Block 16: the first prompt publishes blocks ending at 16, 32, 48 with their snapshots. The
    second shares 40 tokens: pages cover 32 (40 with partial reuse), the snapshot at 32 fits,
    the one at 48 does not, so it resumes at 32 and must still give the fresh engine's beams."""
    reference = references["conv_first"]
    first = random_prompt(reference.vocab_size, 50, 7)
    tail = random_prompt(reference.vocab_size, 17, 8)
    tail[0] = first[40] % (reference.vocab_size - 1) + 1  # differs from first[40]
    second = first[:40] + tail
    assert second[40] != first[40] and len(second) == 57
    params = params_for(3)
    engine = make_engine(reference.directory, 16, enable_partial_reuse)
    run_checked(engine, first, params_for(2))
    reused = run_checked(engine, second, params)
    fresh = run_checked(make_engine(reference.directory, 16, enable_partial_reuse), second, params)

    assert reused.stats["reused_tokens"] == 32
    assert reused.stats["num_tokens_before_hybrid_pruning"] == (40 if enable_partial_reuse else 32)
    assert fresh.stats["reused_tokens"] == 0
    assert [beam.token_ids for beam in reused.beams] == [beam.token_ids for beam in fresh.beams]
    for beam, fresh_beam in zip(reused.beams, fresh.beams, strict=True):
        assert math.isclose(beam.score, fresh_beam.score, rel_tol=0.0, abs_tol=1e-9)
    expected = reference_beams(reference.model, second, 3, MAX_NEW_TOKENS, 1.0, False, None)
    assert_same_beams(reused, expected)
