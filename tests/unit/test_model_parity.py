"""The engine's Llama reproduces transformers' LlamaForCausalLM in float64, through the paged pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import prepare_attention
from engine.config import CacheConfig
from engine.kv_pool import KVPool
from engine.models.decoder import LlamaModel
from engine.models.loader import load_model
from tests.helpers.checkpoints import write_random_llama_checkpoint

TOLERANCE = 1e-9
PROMPT_LENS = (1, 31, 32, 33, 67)
BLOCK_SIZES = (16, 32, 64, 128)
CHECKPOINTS = {  # name: (num_heads, num_kv_heads, tie_word_embeddings, rope_theta)
    "gqa-untied": (4, 2, False, 10000.0),
    "gqa-tied": (4, 1, True, 10000.0),
    "mha-untied": (4, 4, False, 10000.0),
    "mha-tied": (2, 2, True, 500.0),
}


@pytest.fixture(autouse=True)
def few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for seed, (name, (num_heads, num_kv_heads, tied, rope_theta)) in enumerate(CHECKPOINTS.items()):
        dirs[name] = write_random_llama_checkpoint(
            tmp_path_factory.mktemp(name),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            tie_word_embeddings=tied,
            seed=seed,
            rope_theta=rope_theta,
        )
    return dirs


def reference_last_logits(reference: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0, -1]  # [V]


def load_reference(model_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def make_pool(model: LlamaModel, tokens_per_block: int, num_blocks: int = 64) -> KVPool:
    cache = CacheConfig(tokens_per_block=tokens_per_block, num_blocks=num_blocks)
    return KVPool(model.config, cache, model.dtype, "cpu")


def run_step(model: LlamaModel, pool: KVPool, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """seqs: (block_ids, num_cached_tokens, new token ids) -> logits [B, V]."""
    metadata = prepare_attention(
        [(block_ids, cached, len(new_ids)) for block_ids, cached, new_ids in seqs],
        pool.tokens_per_block,
        "cpu",
        sliding_windows=model.config.sliding_windows,
    )
    input_ids = torch.tensor([token for _, _, new_ids in seqs for token in new_ids])
    return model(input_ids, metadata.positions, pool, metadata)


def prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def scattered_blocks(num_blocks: int, total: int) -> list[int]:
    # Descending and spread out, so a bug that assumes adjacent or ordered blocks shows.
    return list(range(total - 1, -1, -2))[:num_blocks]


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("tokens_per_block", BLOCK_SIZES)
def test_prefill_then_decode_matches_transformers(
    checkpoint_dirs: dict[str, Path], checkpoint: str, tokens_per_block: int
) -> None:
    model, config, _ = load_model(checkpoint_dirs[checkpoint], "float64", "cpu")
    reference = load_reference(checkpoint_dirs[checkpoint])
    # Tying survives loading and the dtype cast: one parameter, not two equal copies.
    assert (model.lm_head.weight is model.embed_tokens.weight) == config.tie_word_embeddings
    for prompt_len in PROMPT_LENS:
        pool = make_pool(model, tokens_per_block, num_blocks=16)
        token_ids = prompt(prompt_len, config.vocab_size, seed=prompt_len)
        num_blocks = -(-(prompt_len + 1) // tokens_per_block)
        block_ids = scattered_blocks(num_blocks, pool.num_blocks)

        logits = run_step(model, pool, [(block_ids, 0, token_ids)])[0]
        expected = reference_last_logits(reference, token_ids)
        torch.testing.assert_close(logits, expected, rtol=0, atol=TOLERANCE)

        next_token = int(torch.argmax(logits))
        decode_logits = run_step(model, pool, [(block_ids, prompt_len, [next_token])])[0]
        expected_decode = reference_last_logits(reference, [*token_ids, next_token])
        torch.testing.assert_close(decode_logits, expected_decode, rtol=0, atol=TOLERANCE)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    # original_max_position_embeddings 64 puts head_dim 8's wavelengths (6.3, 63, 628, 6283)
    # in all three bands: kept, interpolated, stretched.
    scaling: dict[str, float | int | str] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model_dir = write_random_llama_checkpoint(tmp_path, seed=11, rope_scaling=scaling)
    model, config, _ = load_model(model_dir, "float64", "cpu")
    assert config.rope_scaling is not None
    token_ids = prompt(67, config.vocab_size, seed=5)
    logits = run_step(model, make_pool(model, 32), [([3, 1, 2], 0, token_ids)])[0]
    expected = reference_last_logits(load_reference(model_dir), token_ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=TOLERANCE)


def test_chunked_prefill_matches_transformers(checkpoint_dirs: dict[str, Path]) -> None:
    model_dir = checkpoint_dirs["gqa-untied"]
    model, config, _ = load_model(model_dir, "float64", "cpu")
    pool = make_pool(model, 16)
    token_ids = prompt(45, config.vocab_size, seed=7)
    block_ids = [5, 2, 9]
    run_step(model, pool, [(block_ids, 0, token_ids[:20])])
    logits = run_step(model, pool, [(block_ids, 20, token_ids[20:])])[0]
    expected = reference_last_logits(load_reference(model_dir), token_ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("tokens_per_block", (16, 32))
def test_mixed_batch_equals_each_sequence_alone(
    checkpoint_dirs: dict[str, Path], tokens_per_block: int
) -> None:
    model, config, _ = load_model(checkpoint_dirs["gqa-untied"], "float64", "cpu")
    prompts = [prompt(length, config.vocab_size, seed=length) for length in (40, 70, 33)]
    # decode_a and decode_b are prefilled first; the mixed step prefills c and decodes a and b.
    blocks = {"a": [0, 1, 2], "b": [3, 4, 5, 6, 7], "c": [8, 9, 10]}
    next_tokens = {"a": 11, "b": 12}

    def prefill_first(pool: KVPool, name: str, token_ids: list[int]) -> None:
        run_step(model, pool, [(blocks[name], 0, token_ids)])

    batched_pool = make_pool(model, tokens_per_block)
    prefill_first(batched_pool, "a", prompts[0])
    prefill_first(batched_pool, "b", prompts[1])
    mixed_steps = [
        (blocks["c"], 0, prompts[2]),
        (blocks["a"], len(prompts[0]), [next_tokens["a"]]),
        (blocks["b"], len(prompts[1]), [next_tokens["b"]]),
    ]
    batched = run_step(model, batched_pool, mixed_steps)

    for row, step in enumerate(mixed_steps):
        alone_pool = make_pool(model, tokens_per_block)
        prefill_first(alone_pool, "a", prompts[0])
        prefill_first(alone_pool, "b", prompts[1])
        alone = run_step(model, alone_pool, [step])[0]
        torch.testing.assert_close(batched[row], alone, rtol=0, atol=1e-12)
        # The pages written by the batched step equal those written alone.
        block_ids = step[0]
        torch.testing.assert_close(
            batched_pool.data[block_ids], alone_pool.data[block_ids], rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_lower_precision_is_close_to_float64(checkpoint_dirs: dict[str, Path], dtype: str) -> None:
    model_dir = checkpoint_dirs["gqa-tied"]
    reference_model, config, _ = load_model(model_dir, "float64", "cpu")
    model, _, _ = load_model(model_dir, dtype, "cpu")
    token_ids = prompt(33, config.vocab_size, seed=3)
    exact = run_step(reference_model, make_pool(reference_model, 16), [([0, 1, 2], 0, token_ids)])
    approximate = run_step(model, make_pool(model, 16), [([0, 1, 2], 0, token_ids)])
    assert approximate.dtype == torch.float32
    tolerance = 1e-4 if dtype == "float32" else 0.25
    torch.testing.assert_close(approximate.double(), exact, rtol=0, atol=tolerance)


def test_sharded_checkpoint_loads_the_same_model(tmp_path: Path, checkpoint_dirs: dict[str, Path]) -> None:
    sharded_dir = write_random_llama_checkpoint(
        tmp_path, num_heads=4, num_kv_heads=2, tie_word_embeddings=False, seed=0, max_shard_size="20KB"
    )
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    sharded, _, _ = load_model(sharded_dir, "float64", "cpu")
    whole, _, _ = load_model(checkpoint_dirs["gqa-untied"], "float64", "cpu")
    assert sharded.state_dict().keys() == whole.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(sharded.state_dict()[name], tensor), name


def test_checkpoint_that_disagrees_with_its_config_is_refused(
    checkpoint_dirs: dict[str, Path], tmp_path: Path
) -> None:
    import json
    import shutil

    source = checkpoint_dirs["gqa-untied"]
    shutil.copy(source / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path, "float64", "cpu")
