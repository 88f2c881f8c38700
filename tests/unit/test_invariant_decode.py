"""The decode side of the invariant attention (engine/invariant_decode.py), issue 29.

Its batched matmuls per bucket read every kv head's items head-major (keys a row stride of D
apart); until issue 29 a matmul per kv head read them in the pool's page layout (Hkv D apart).
These tests hold the facts that change relies on: the two give every item the same bits, on
this host, for the decode shapes, whatever the number of items in the call; a layer's plan is
built once per step; the rows view reads the pool's own bytes.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import paged_attention, prepare_attention
from engine.invariant_decode import PAGES_PER_ITEM, items_bmm, kv_rows_view

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_head_major_items_equal_the_per_head_matmuls_of_the_page_layout(
    dtype: torch.dtype, num_threads: int
) -> None:
    """scores [R G, D] x [D, K] and P @ V [R G, K] x [K, D] for n items of Hkv kv heads: items_bmm
    over Hkv n head-major items gives each item the bits items_bmm per kv head over the page
    layout gives it (whose last call, padded, is a contiguous copy), for every R of a beam
    request, 1 to 5 items and the GQA shapes of the models here, and the bits it gets in a call
    of 1, 2 or all but one of the items (calls of a fixed count: on an AMD EPYC an item's bits
    changed with the number of items in a batched matmul)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        generator = torch.Generator().manual_seed(3)
        keys_per_item = PAGES_PER_ITEM * 32
        for num_kv_heads, group, head_dim in ((3, 3, 64), (2, 4, 64), (1, 8, 64), (4, 2, 128), (8, 1, 32)):
            for size in (1, 2, 3, 4):
                for num_items in (1, 2, 5):
                    # Page layout [n, K, Hkv, D], as the pool holds a page; rows [Hkv, n, R G, D].
                    keys = torch.randn(
                        num_items, keys_per_item, num_kv_heads, head_dim, generator=generator
                    ).to(dtype)
                    values = torch.randn(keys.shape, generator=generator).to(dtype)
                    rows = torch.randn(
                        num_kv_heads, num_items, size * group, head_dim, generator=generator
                    ).to(dtype)
                    weights = torch.rand(
                        num_kv_heads, num_items, size * group, keys_per_item, generator=generator
                    )
                    weights = weights.to(dtype)
                    per_head_scores = torch.empty(
                        num_kv_heads, num_items, size * group, keys_per_item, dtype=dtype
                    )
                    per_head_partial = torch.empty(
                        num_kv_heads, num_items, size * group, head_dim, dtype=dtype
                    )
                    for head in range(num_kv_heads):
                        items_bmm(rows[head], keys[:, :, head], per_head_scores[head], transpose=True)
                        items_bmm(weights[head], values[:, :, head], per_head_partial[head], transpose=False)
                    batch = num_kv_heads * num_items
                    head_major_keys = keys.permute(2, 0, 1, 3).reshape(batch, keys_per_item, head_dim)
                    head_major_values = values.permute(2, 0, 1, 3).reshape(batch, keys_per_item, head_dim)
                    scores = torch.empty(batch, size * group, keys_per_item, dtype=dtype)
                    partial = torch.empty(batch, size * group, head_dim, dtype=dtype)
                    items_bmm(
                        rows.reshape(batch, size * group, head_dim), head_major_keys, scores, transpose=True
                    )
                    weights_rows = weights.reshape(batch, size * group, keys_per_item)
                    items_bmm(weights_rows, head_major_values, partial, transpose=False)
                    # An item's bits do not depend on how many items share the call, one included.
                    for count in {1, 2, batch - 1} & set(range(1, batch + 1)):
                        alone = torch.empty(count, size * group, keys_per_item, dtype=dtype)
                        items_bmm(rows.reshape(batch, size * group, head_dim)[-count:],
                                  head_major_keys[-count:], alone, transpose=True)  # fmt: skip
                        assert torch.equal(alone, scores[-count:]), (shape_of := (count, size, group))
                        alone_partial = torch.empty(count, size * group, head_dim, dtype=dtype)
                        items_bmm(
                            weights_rows[-count:],
                            head_major_values[-count:],
                            alone_partial,
                            transpose=False,
                        )
                        assert torch.equal(alone_partial, partial[-count:]), shape_of
                    shape = (num_kv_heads, group, head_dim, size, num_items)
                    assert torch.equal(scores.view(per_head_scores.shape), per_head_scores), shape
                    assert torch.equal(partial.view(per_head_partial.shape), per_head_partial), shape
    finally:
        torch.set_num_threads(previous)


def test_kv_rows_view_reads_the_pools_rows_and_refuses_other_layouts() -> None:
    """Block b's (kind, t, h) of a pool layer (blocks L layers apart) is row b L 2 T Hkv + (kind T + t) Hkv + h."""
    pool = torch.randn(6, 3, 2, 4, 2, 8)  # [blocks, L, 2, T, Hkv, D]
    layer = pool[:, 1]
    rows = kv_rows_view(layer)
    for block, kind, token, head in ((0, 0, 0, 0), (5, 1, 3, 1), (2, 1, 0, 1), (4, 0, 2, 0)):
        row = block * 3 * 2 * 4 * 2 + (kind * 4 + token) * 2 + head
        assert torch.equal(rows[row], layer[block, kind, token, head])
    with pytest.raises(ValueError, match="strides"):
        kv_rows_view(pool.transpose(3, 4)[:, 1])


def test_one_plan_per_step_serves_every_layer() -> None:
    """Two layers of one step (two pool layers) reuse the plan the first built; a sliding layer
    gets its own (its hidden keys differ), and the rows equal those of a fresh layout."""
    generator = torch.Generator().manual_seed(9)
    pool = torch.randn(30, 2, 2, 32, 2, 64, generator=generator)  # [blocks, L, 2, T, Hkv, D]
    seqs = [(list(range(1, 11)) + [20 + beam], 330, 1) for beam in range(3)] + [([25, 26], 40, 1)]
    metadata = prepare_attention(seqs, 32, "cpu", [True] * 4, [3, 3, 3, 1], (64,))
    assert metadata.invariant is not None
    (part,) = metadata.invariant.slices
    query = torch.randn(4, 8, 64, generator=generator)
    first = paged_attention(query, pool[:, 0], metadata, 0.125)
    second = paged_attention(query, pool[:, 1], metadata, 0.125)
    assert len(part.plans) == 1
    windowed = paged_attention(query, pool[:, 1], metadata, 0.125, sliding_window=64)
    assert len(part.plans) == 2
    part.check_integrity()
    fresh = prepare_attention(seqs, 32, "cpu", [True] * 4, [3, 3, 3, 1], (64,))
    assert torch.equal(paged_attention(query, pool[:, 1], fresh, 0.125), second)
    assert torch.equal(paged_attention(query, pool[:, 1], fresh, 0.125, sliding_window=64), windowed)
    assert not torch.equal(first, second)
