"""The decode step's small ops in fewer calls, with the bits they had (issue 29, branch perf4).

Each rewrite here rests on an arithmetic fact; these tests hold the fact on random data in every
dtype the engine serves, against the form the code had before: rotary with its negation moved
onto the table and q and k rotated together, the tree over items run once for numerator and
denominator side by side, the unit maximum by scatter_reduce, and the K/V gather into a buffer
the step's layers share.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import prepare_attention, write_kv
from engine.invariant_decode import kv_rows_view, tree_sum
from engine.models.decoder import RotaryEmbedding, adjacent_columns, apply_rotary_table, rotary_table
from engine.models.q8_embedding import same_bits

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def apply_rotary(tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: transformers' form, tensor [N, heads, D], cos and sin [N, D]."""
    half = tensor.shape[-1] // 2
    rotated_half = torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)
    return tensor * cos[:, None, :] + rotated_half * sin[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_table_gives_apply_rotarys_bits_for_q_and_k_together(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 9, 3, 64
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 8191])
    cos, sin = RotaryEmbedding(head_dim, 10000.0)(positions, dtype)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    query, key, _ = fused.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), -1)
    expected_query = apply_rotary(query.reshape(num_tokens, num_heads, head_dim), cos, sin)
    expected_key = apply_rotary(key.reshape(num_tokens, num_kv_heads, head_dim), cos, sin)
    table_cos, signed_sin = rotary_table(cos, sin)
    together = adjacent_columns(query, key)
    assert together is not None and together.data_ptr() == fused.data_ptr()
    rotated = apply_rotary_table(
        together.view(num_tokens, num_heads + num_kv_heads, head_dim), table_cos, signed_sin
    )
    new_query, new_key = rotated.split((num_heads, num_kv_heads), dim=1)
    assert same_bits(new_query, expected_query) and same_bits(new_key, expected_key)
    apart = apply_rotary_table(query.reshape(num_tokens, num_heads, head_dim), table_cos, signed_sin)
    assert same_bits(apart, expected_query)


def test_adjacent_columns_only_for_columns_that_follow_in_one_storage() -> None:
    fused = torch.randn(4, 10)
    first, second, third = fused.split((3, 4, 3), dim=-1)
    assert adjacent_columns(first, third) is None  # a gap
    assert adjacent_columns(second, first) is None  # the wrong order
    assert adjacent_columns(first, torch.randn(4, 4)) is None  # another tensor
    assert adjacent_columns(torch.randn(4, 3), torch.randn(4, 4)) is None
    both = adjacent_columns(first, second)
    assert both is not None and torch.equal(both, fused[:, :7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_tree_over_numerator_and_denominator_side_by_side(dtype: torch.dtype) -> None:
    """The pre-perf4 decode kernel summed partial outputs and weight sums in two trees over
    items, each from a zero-filled scatter; side by side as D + 1 columns they get the same
    bits, and scatter_reduce's maximum is the leaves' maximum."""
    generator = torch.Generator().manual_seed(11)
    num_kv_heads, num_units, num_leaves, group, head_dim, keys = 3, 4, 4, 3, 64, 128
    num_slots = num_kv_heads * num_units * num_leaves * group
    row_leaf = torch.randperm(num_slots, generator=generator)[: num_slots - 9]  # some leaves unused
    row_unit = (row_leaf // (num_leaves * group)) * group + row_leaf % group
    num_rows = row_leaf.shape[0]
    scores = torch.randn(num_rows, keys, generator=generator).to(dtype) * 4
    weights = torch.rand(num_rows, keys, generator=generator).to(dtype)
    partial = torch.randn(num_rows, head_dim, generator=generator).to(dtype)
    leaf_shape = (num_kv_heads, num_units, num_leaves, group)
    # Before: two scatters, two trees.
    leaves = partial.new_zeros((num_slots, head_dim))
    leaves[row_leaf] = partial
    numerator = tree_sum(leaves.view(*leaf_shape, head_dim), dim=2)
    weight_leaves = weights.new_zeros((num_slots,))
    weight_leaves[row_leaf] = tree_sum(weights, dim=-1)
    denominator = tree_sum(weight_leaves.view(leaf_shape), dim=2)
    item_max = scores.new_full((num_slots,), float("-inf"))
    item_max[row_leaf] = scores.amax(dim=-1)
    expected_max = item_max.view(leaf_shape).amax(dim=2).reshape(-1)
    # After.
    both = partial.new_zeros((num_slots, head_dim + 1))
    both[row_leaf] = torch.cat((partial, tree_sum(weights, dim=-1)[:, None]), dim=1)
    sums = tree_sum(both.view(*leaf_shape, head_dim + 1), dim=2)
    unit_max = scores.new_full((math.prod(leaf_shape) // num_leaves,), float("-inf"))
    unit_max.scatter_reduce_(0, row_unit, scores.amax(dim=-1), "amax")
    assert same_bits(sums[..., :head_dim], numerator) and same_bits(sums[..., head_dim], denominator)
    assert same_bits(sums[..., :head_dim] / sums[..., head_dim:], numerator / denominator[..., None])
    assert same_bits(unit_max, expected_max)


def test_write_kv_with_the_passs_block_offsets_writes_the_slots() -> None:
    """prepare_attention splits slot_mapping once a pass; write_kv puts each token's K/V in its
    slot and nowhere else."""
    tokens_per_block, num_kv_heads, head_dim = 4, 2, 8
    pool = torch.zeros(6, 2, tokens_per_block, num_kv_heads, head_dim)
    metadata = prepare_attention([([3, 1], 2, 3), ([5], 0, 1)], tokens_per_block, "cpu")
    assert metadata.slot_blocks.tolist() == [3, 3, 1, 5] and metadata.slot_offsets.tolist() == [2, 3, 0, 0]
    key = torch.randn(4, num_kv_heads, head_dim)
    value = torch.randn(4, num_kv_heads, head_dim)
    write_kv(pool, key, value, metadata)
    for token, (block, offset) in enumerate(((3, 2), (3, 3), (1, 0), (5, 0))):
        assert torch.equal(pool[block, 0, offset], key[token]) and torch.equal(
            pool[block, 1, offset], value[token]
        )
    assert int((pool != 0).any(dim=(-1, -2)).sum()) == 8  # 4 tokens, key and value


def test_decode_gather_reuses_one_buffer_and_matches_index_select() -> None:
    """Every layer of a step gathers into the plan's buffer (bfloat16 pages widened into a
    float32 one): the same values as a fresh index_select, no new storage after the first."""
    generator = torch.Generator().manual_seed(2)
    tokens_per_block, num_kv_heads, head_dim = 32, 3, 64
    layers = torch.randn(2, 9, 2, tokens_per_block, num_kv_heads, head_dim, generator=generator)
    layers = layers.to(torch.bfloat16)
    metadata = prepare_attention(
        [([1, 2, 3, 4, 5], 140, 1)] * 4, tokens_per_block, "cpu", [True] * 4, [4] * 4
    )
    assert metadata.invariant is not None
    part = metadata.invariant.slices[0]
    plan = part.plan_for(num_kv_heads, 3, None, layers[0])
    pointers = set()
    for layer in layers:
        rows = kv_rows_view(layer)
        gathered = plan.gather_kv(rows, torch.float32)
        assert torch.equal(gathered, rows.index_select(0, plan.kv_rows).to(torch.float32))
        pointers.add(gathered.data_ptr())
    assert len(pointers) == 1 and set(plan.buffers) == {torch.bfloat16, torch.float32}
    part.check_integrity()
