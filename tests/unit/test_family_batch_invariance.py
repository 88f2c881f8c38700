"""float32 batch invariance for the families with their own attention or feed-forward: Qwen3 (q/k
norm), Qwen3-MoE (experts) and Gemma 3 (sliding and full layers, sandwich norms, soft-capping).

Requests of prompt lengths short of, at and well past the sliding window (16), widths 1 to 4 and
a shared prefix join and leave one batch-invariant engine; each one's beams (tokens, scores,
cumulative log-probs) equal its run alone in a fresh engine, bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import CacheConfig, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.attention import paged_attention, prepare_attention
from tests.helpers.family_checkpoints import write_family_checkpoint

pytest.importorskip("transformers")

WINDOW = 16
# Wider than the parity checkpoints, so the plain kernels' shapes would change the bits.
SIZES = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}
FAMILY_SIZES = {
    "qwen3": {**SIZES, "head_dim": 32},
    "qwen3_moe": {**SIZES, "head_dim": 32, "moe_intermediate_size": 64},
    "gemma3": {**SIZES, "head_dim": 32, "sliding_window": WINDOW},
}

Beams = list[tuple[list[int], float, float]]


def windowed_rows(
    seqs: list[tuple[list[int], int, int]],
    is_decode: list[bool] | None,
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    metadata = prepare_attention(seqs, kv_layer.shape[2], "cpu", is_decode, sliding_windows=(5, WINDOW, 40))
    return paged_attention(query, kv_layer, metadata, 0.125, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_windowed_attention_rows_match_the_padded_kernel_and_ignore_the_batch(dtype: torch.dtype) -> None:
    """A 150-token prompt and decode steps under windows 5, 16 and 40 (and none): the invariant
    kernel equals the padded one; chunks and batch neighbours leave a row's bits unchanged; keys
    out of the window do not count (changing them changes nothing)."""
    generator = torch.Generator().manual_seed(4)
    tokens_per_block, num_heads, num_kv_heads, head_dim = 16, 4, 2, 32
    kv_layer = torch.randn(40, 2, tokens_per_block, num_kv_heads, head_dim, generator=generator).to(dtype)
    blocks = [3, 7, 1, 12, 30, 22, 9, 15, 17, 19]
    query = torch.randn(150, num_heads, head_dim, generator=generator).to(dtype)
    decode_query = torch.randn(1, num_heads, head_dim, generator=generator).to(dtype)
    for window in (5, WINDOW, 40, None):
        whole = windowed_rows([(blocks, 0, 150)], [False], query, kv_layer, window)
        plain = windowed_rows([(blocks, 0, 150)], None, query, kv_layer, window)
        torch.testing.assert_close(whole, plain)
        chunk = windowed_rows([(blocks[:10], 70, 80)], [False], query[70:], kv_layer, window)
        assert torch.equal(chunk, whole[70:]), window
        decode = windowed_rows([(blocks, 150, 1)], [True], decode_query, kv_layer, window)
        beside = windowed_rows(
            [([5, 6], 20, 1), (blocks, 150, 1)],
            [True, True],
            torch.cat((decode_query, decode_query)),
            kv_layer,
            window,
        )
        assert torch.equal(beside[1:], decode), window
        torch.testing.assert_close(
            decode, windowed_rows([(blocks, 150, 1)], None, decode_query, kv_layer, window)
        )
        if window is not None:
            # Position 150 sees keys 151 - W .. 150: overwrite every key before that; nothing moves.
            changed = kv_layer.clone()
            for position in range(151 - window):
                changed[blocks[position // tokens_per_block], :, position % tokens_per_block] = 7.0
            assert torch.equal(
                windowed_rows([(blocks, 150, 1)], [True], decode_query, changed, window), decode
            )
            unchanged = windowed_rows([(blocks, 150, 1)], [True], decode_query, kv_layer, None)
            assert not torch.equal(unchanged, decode)


def make_engine(model_dir: Path) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=16, num_blocks=256)
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", cache=cache, batch_invariant=True))


def mixed_requests(vocab_size: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(5)
    common = [rng.randrange(3, vocab_size) for _ in range(35)]  # 2 full blocks shared by a third
    requests = []
    for index in range(6):
        length = [5, 17, 70, 9, 130, 33][index]
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        if index % 3 == 0:
            prompt = common + prompt
        params = SamplingParams(
            beam_width=[1, 2, 4, 3][index % 4], max_new_tokens=4 + index % 3, ignore_eos=True
        )
        requests.append((f"r{index}", prompt, params))
    return requests


def beams_of(output: RequestOutput) -> Beams:
    assert output.error is None, output.error
    return [(beam.token_ids, beam.score, beam.cumulative_logprob) for beam in output.beams]


@pytest.mark.parametrize("family", list(FAMILY_SIZES))
def test_family_requests_in_a_changing_batch_equal_their_runs_alone(tmp_path: Path, family: str) -> None:
    model_dir = write_family_checkpoint(tmp_path, family, seed=9, **FAMILY_SIZES[family])
    requests = mixed_requests(SIZES["vocab_size"])
    alone = {
        request_id: beams_of(make_engine(model_dir).generate(prompt, params))
        for request_id, prompt, params in requests
    }
    engine = make_engine(model_dir)
    together: dict[str, Beams] = {}
    waiting, step = list(requests), 0
    while waiting or engine.has_unfinished():
        if waiting and step % 2 == 0:  # three join every other step while others run and leave
            for request_id, prompt, params in waiting[:3]:
                engine.add_request(request_id, prompt, params)
            waiting = waiting[3:]
        for output in engine.step():
            if output.finished:
                together[output.request_id] = beams_of(output)
        engine.check_integrity()
        step += 1
    assert engine.counters().reused_tokens > 0  # the shared prefix was reused inside the batch
    assert engine.num_blocks_in_use() == 0
    different = [request_id for request_id in alone if together[request_id] != alone[request_id]]
    assert not different, f"{len(different)} of {len(alone)} requests changed in the batch: {different}"
