"""Every family's decoder reproduces transformers' *ForCausalLM in float64, through the paged pool.

Tiny random checkpoints (tests/helpers/family_checkpoints.py) with a sliding window of 8 where
the family has one; prompts shorter than, at and past the window and across block boundaries,
blocks 16 and 32, a prefill then a decode step, and a prefill in two chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.loader import load_model
from tests.helpers.family_checkpoints import SLIDING_WINDOW, load_reference, write_family_checkpoint
from tests.unit.test_model_parity import make_pool, prompt, run_step

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-12
PROMPT_LENS = (1, 7, 8, 9, 16, 17, 40)
FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "phi3")
# The families whose tiny checkpoint has sliding layers, and the window each declares per layer.
WINDOWS = {
    "qwen2": (None, SLIDING_WINDOW),
    "qwen3": (None, None),
    "qwen3_moe": (None, None, None),
    "mistral": (SLIDING_WINDOW, SLIDING_WINDOW),
    "gemma3": (SLIDING_WINDOW, None, SLIDING_WINDOW),
    "phi3": (SLIDING_WINDOW, SLIDING_WINDOW),
}


@pytest.fixture(autouse=True)
def few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        family: write_family_checkpoint(tmp_path_factory.mktemp(family), family, seed=seed)
        for seed, family in enumerate(FAMILIES)
    }


def reference_logits(reference: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0, -1]  # [V]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_matches_transformers(checkpoints: dict[str, Path], family: str) -> None:
    model, config, _ = load_model(checkpoints[family], "float64", "cpu")
    reference = load_reference(family, checkpoints[family], torch.float64)
    assert config.traits.family == family
    assert config.kv_layer_windows == WINDOWS[family]
    assert (model.lm_head.weight is model.embed_tokens.weight) == config.tie_word_embeddings
    for tokens_per_block in (16, 32):
        for prompt_len in PROMPT_LENS:
            pool = make_pool(model, tokens_per_block, num_blocks=16)
            token_ids = prompt(prompt_len, config.vocab_size, seed=prompt_len)
            block_ids = list(range(15, -1, -2))[: -(-(prompt_len + 1) // tokens_per_block)]
            logits = run_step(model, pool, [(block_ids, 0, token_ids)])[0]
            torch.testing.assert_close(logits, reference_logits(reference, token_ids), rtol=0, atol=TOLERANCE)
            next_token = int(torch.argmax(logits))
            decode = run_step(model, pool, [(block_ids, prompt_len, [next_token])])[0]
            expected = reference_logits(reference, [*token_ids, next_token])
            torch.testing.assert_close(decode, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_across_the_window_matches_transformers(
    checkpoints: dict[str, Path], family: str
) -> None:
    model, config, _ = load_model(checkpoints[family], "float64", "cpu")
    reference = load_reference(family, checkpoints[family], torch.float64)
    token_ids = prompt(45, config.vocab_size, seed=7)
    pool = make_pool(model, 16)
    run_step(model, pool, [([5, 2, 9], 0, token_ids[:13])])
    logits = run_step(model, pool, [([5, 2, 9], 13, token_ids[13:])])[0]
    torch.testing.assert_close(logits, reference_logits(reference, token_ids), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("family", ("mistral", "gemma3"))
def test_the_window_changes_what_a_long_prompt_sees(tmp_path: Path, family: str) -> None:
    """The same weights without the window give other logits past the window (so the parity above
    proves the window, not a model that ignores it) and the same ones within it."""
    windowed, config, _ = load_model(
        write_family_checkpoint(tmp_path / "w", family, seed=1), "float64", "cpu"
    )
    full, _, _ = load_model(
        write_family_checkpoint(tmp_path / "f", family, seed=1, sliding_window=4096), "float64", "cpu"
    )
    short, long = prompt(SLIDING_WINDOW, config.vocab_size, seed=2), prompt(30, config.vocab_size, seed=3)

    def last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
        return run_step(model, make_pool(model, 16), [([0, 1], 0, token_ids)])[0]

    torch.testing.assert_close(last_logits(windowed, short), last_logits(full, short), rtol=0, atol=0)
    assert (last_logits(windowed, long) - last_logits(full, long)).abs().max() > 1e-3
