"""Decode tokens of the batch-invariant attention: fixed items of pages, summed by a pairwise tree.

A decode token alone (G rows per kv head) reads items of PAGES_PER_ITEM pages (K = 64 keys at
T = 32): scores [R G, D] x [D, K] and P @ V [R G, K] x [K, D] are fixed-shape items of a batched
matmul whose strides are constants, R the beams of one request that read the same item at the
same position (a function of the request's own beams, never of the batch). Items are summed by
`tree_sum`, the softmax denominators too (each item's by `sum` over its keys, then over items): a
pairwise tree with a fixed leaf for each item, so items past a token's position (or padding up to
the batch's longest context) only ever add exact zeros, and such items are never computed.
torch's own `sum` is not safe over items: measured, summing a middle axis whose inner size is
under 16 or so changes bits with the axis length and the row count. Over an item's keys (the last
axis, always K long) it is safe, and one op instead of a tree (issue 29, stop 28).

Cost (issue 29): the step's index tensors are built once per step (`DecodePlan`, one per head
layout and window, shared by every layer), so a layer runs about 35 tensor ops and two matmuls
per ITEMS_PER_CALL items: one `index_select` gathers every item's keys and values, head-major,
from the pool seen as rows of D; batched matmuls per bucket of R (all kv heads and items
together, in calls of a fixed ITEMS_PER_CALL items since stop 30: items_bmm) for the scores, the
same for P @ V; every element-wise step over all rows at once. Before, a layer of a lone beam-4
request ran about 400 (a matmul per kv head and bucket, and a gather, scatter and copy per
bucket): 24 ms of the 135M model's 91 ms float32 decode step, about half that now
(docs/benchmarks.md). An item's matmul reads its keys with a row stride of D instead of Hkv D:
measured to give the same bits (tests/unit/test_invariant_decode.py). Since issue 29's fourth
session (branch perf4) a layer runs fewer: the numerator and the denominator go through one tree
over items as D + 1 columns side by side (the tree's adds are element-wise: each column keeps its
bits), the unit maximum is one scatter_reduce, and every layer gathers its keys and values into
one buffer of the step's plan instead of a fresh 22 MB for 16 beam-4 requests
(tests/unit/test_decode_step_ops.py holds each against the earlier form).

Dimensions: U decode tokens (units), I items of the slice's longest unit, V visible (unit, item)
pairs, P pages per item, T tokens per page, K = P T keys per item, Hkv kv heads, G = H / Hkv,
D head dim; a bucket holds n items read by R pairs each; S score rows = (pair, kv head, g).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Keys of one decode token's attention item: 2 pages (64 keys at T = 32). Measured against 1 and 4
# (docs/benchmarks.md, issue 29 perf5): 4-page items mix a request's shared prompt pages with each
# beam's own, so each beam gathered and multiplied them apart; 1-page items gather least but
# double the pairs, the partial outputs and the tree over items.
PAGES_PER_ITEM = 2
# Items of one batched matmul (items_bmm): a fixed count, so the BLAS's choice never depends on how
# many items the step has.
ITEMS_PER_CALL = 8


@dataclass(frozen=True)
class DecodeBucket:
    """Items each read by the same number R of pairs (one request's beams at one position).

    Its pairs are [first_pair, first_pair + num_items * num_shared), item by item."""

    num_shared: int  # R
    num_items: int  # n
    first_pair: int


@dataclass(frozen=True)
class DecodePlan:
    """A slice's index tensors for one head layout, window and pool stride: built at the step's
    first layer, read by all. Score rows run bucket by bucket, then [kv head, item, member, g];
    keys and values [kind, bucket, kv head, item, page, t]."""

    query_rows: torch.Tensor  # [S / G] row (token Hkv + kv head) of the query seen as [N Hkv, G D]
    kv_rows: torch.Tensor  # [2 Hkv sum(n) K] row of the layer seen as rows of D (kv_rows_view)
    hidden: torch.Tensor  # [S, K] bool: the key is hidden from the row (past it, or out of its window)
    row_leaf: torch.Tensor  # [S] the row's leaf (kv head, unit, item, g) in the tree over items
    # I rounded up to a power of two: the tree then never appends a zero leaf (a zero leaf gives
    # the bits tree_sum's appended ones give: tests/unit/test_batch_invariance.py)
    num_leaves: int
    row_unit: torch.Tensor  # [S] the row's (kv head, unit, g)
    # Per bucket: (first query row, first score row, first key row)
    offsets: tuple[tuple[int, int, int], ...]
    # The gathered keys and values, by dtype: one buffer the step's layers take in turn (a layer's
    # attention is done with it before the next layer gathers)
    buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def gather_kv(self, kv_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """kv_rows (kv_rows_view of a layer) -> this plan's key and value rows [2 Hkv sum(n) K, D] in
        `dtype`, written into the step's buffer (no allocation per layer: 22 MB a layer for 16
        beam-4 requests). The buffer is overwritten by the next layer's gather."""
        shape = (self.kv_rows.shape[0], kv_rows.shape[1])
        if kv_rows.dtype not in self.buffers:
            self.buffers[kv_rows.dtype] = kv_rows.new_empty(shape)
        gathered = torch.index_select(kv_rows, 0, self.kv_rows, out=self.buffers[kv_rows.dtype])
        if dtype == kv_rows.dtype:
            return gathered
        if dtype not in self.buffers:
            self.buffers[dtype] = gathered.new_empty(shape, dtype=dtype)
        return self.buffers[dtype].copy_(gathered)


@dataclass(frozen=True)
class AttentionSlice:
    """Decode tokens that are computed together (one slice bounds the memory).

    Only the (unit, item) pairs a unit can see are computed: an item wholly past a unit's last
    position (padding up to the slice's longest context) would add exact zeros, so it is left out
    and its place in the tree sum holds zeros (same bits, less work). Pairs run bucket by bucket."""

    token_index: torch.Tensor  # [U, 1] index into the N new tokens
    num_items: int  # I: items of the slice's longest unit
    pair_unit: torch.Tensor  # [V] the unit of each visible pair
    pair_slot: torch.Tensor  # [V] unit * I + item: the pair's leaf in the unit's tree sum
    pair_pages: torch.Tensor  # [V, pages per item] the item's pages (block 0 past the context)
    hidden_keys: torch.Tensor  # [V, 1, K] bool: key k of the pair's item is hidden from the unit
    # Per R, the member pairs [items, R] of a bucket (R is a function of the request's own beams)
    shared: tuple[torch.Tensor, ...] = ()
    buckets: tuple[DecodeBucket, ...] = ()
    # Per sliding window W of the model: hidden_keys with the keys at or before position - W hidden too.
    window_hidden_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    # Plans built this step, by (Hkv, G, window, rows per block, T): every layer after the first reuses one.
    plans: dict[tuple[int, int, int | None, int, int], DecodePlan] = field(
        default_factory=dict, compare=False, repr=False
    )

    def hidden_keys_for(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.hidden_keys
        if sliding_window not in self.window_hidden_keys:
            raise ValueError(f"no decode layout for sliding window {sliding_window}")
        return self.window_hidden_keys[sliding_window]

    def check_integrity(self) -> None:
        """Every plan built this step covers the slice's pairs: one score row per (pair, kv head,
        g), K/V rows for each bucket's items, one leaf per row inside the tree, the layout's keys
        hidden."""
        num_pairs, keys_per_item = self.pair_unit.shape[0], self.hidden_keys.shape[-1]
        num_items = sum(bucket.num_items for bucket in self.buckets)
        for (num_kv_heads, group, window, _, tokens_per_block), plan in self.plans.items():
            assert (
                plan.query_rows.shape[0] * group == plan.hidden.shape[0] == num_kv_heads * num_pairs * group
            )
            assert plan.kv_rows.shape[0] == 2 * num_kv_heads * num_items * keys_per_item
            assert keys_per_item == PAGES_PER_ITEM * tokens_per_block and plan.num_leaves >= self.num_items
            num_leaf_slots = num_kv_heads * self.token_index.shape[0] * plan.num_leaves * group
            assert 0 <= int(plan.row_leaf.min()) and int(plan.row_leaf.max()) < num_leaf_slots
            assert plan.row_leaf.unique().numel() == plan.row_leaf.numel()
            assert [offset[0] for offset in plan.offsets] == [
                num_kv_heads * b.first_pair for b in self.buckets
            ]
            assert int(plan.hidden.sum()) == num_kv_heads * group * int(self.hidden_keys_for(window).sum())
            # The step's gather buffers: one row per K/V row of the plan, one buffer per dtype
            assert all(buffer.shape[0] == plan.kv_rows.shape[0] for buffer in plan.buffers.values())
            assert all(dtype == buffer.dtype for dtype, buffer in plan.buffers.items())

    def plan_for(
        self, num_kv_heads: int, group: int, sliding_window: int | None, kv_layer: torch.Tensor
    ) -> DecodePlan:
        key = (
            num_kv_heads,
            group,
            sliding_window,
            kv_layer.stride(0) // kv_layer.shape[-1],
            kv_layer.shape[2],
        )
        if key not in self.plans:
            self.plans[key] = _make_plan(
                self, num_kv_heads, group, self.hidden_keys_for(sliding_window), *key[3:]
            )
        return self.plans[key]


def make_slice(
    groups: list[list[tuple[int, int, Sequence[int]]]],
    max_pages: int,
    tokens_per_block: int,
    device: torch.device | str,
    sliding_windows: Sequence[int] = (),
) -> AttentionSlice:
    """groups: per request, (token index, position, block ids) of each decoding beam."""
    num_items = -(-max_pages // PAGES_PER_ITEM)
    keys_per_item = PAGES_PER_ITEM * tokens_per_block
    token_index: list[list[int]] = []
    # Per visible pair: (unit, slot, pages, position within the item), in discovery order
    pairs: list[tuple[int, int, list[int], int]] = []
    by_size: dict[int, list[list[int]]] = {}
    for group in groups:
        # (item pages, position) -> the pairs of this request's beams that read it
        readers: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for token, position, pages in group:
            unit = len(token_index)
            token_index.append([token])
            for item in range(position // keys_per_item + 1):
                item_pages = list(pages[item * PAGES_PER_ITEM : (item + 1) * PAGES_PER_ITEM])
                item_pages += [0] * (PAGES_PER_ITEM - len(item_pages))
                readers.setdefault((tuple(item_pages), position), []).append(len(pairs))
                pairs.append((unit, unit * num_items + item, item_pages, position - item * keys_per_item))
        for members in readers.values():
            by_size.setdefault(len(members), []).append(members)
    # Bucket by bucket (R ascending), item by item: a bucket's pairs are one contiguous range.
    order = [pair for size in sorted(by_size) for members in by_size[size] for pair in members]
    ordered = [pairs[index] for index in order]
    buckets, shared, first = [], [], 0
    for size in sorted(by_size):
        count = len(by_size[size])
        buckets.append(DecodeBucket(size, count, first))
        shared.append(torch.arange(first, first + count * size, device=device).view(count, size))
        first += count * size
    key_offsets = torch.arange(keys_per_item, device=device)  # [K]
    positions = torch.tensor([[pair[3]] for pair in ordered], dtype=torch.long, device=device)  # [V, 1]
    hidden_keys = key_offsets[None, None, :] > positions[:, :, None]  # [V, 1, K]
    # Key k of a pair's item is at position - (its position within the item - k): out of a window W
    # when k <= position_in_item - W.
    window_hidden_keys = {
        window: hidden_keys | (key_offsets[None, None, :] <= positions[:, :, None] - window)
        for window in sliding_windows
    }

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return AttentionSlice(
        token_index=as_tensor(token_index),
        num_items=num_items,
        pair_unit=as_tensor([pair[0] for pair in ordered]),
        pair_slot=as_tensor([pair[1] for pair in ordered]),
        pair_pages=as_tensor([pair[2] for pair in ordered]),
        hidden_keys=hidden_keys,
        shared=tuple(shared),
        buckets=tuple(buckets),
        window_hidden_keys=window_hidden_keys,
    )


def _make_plan(
    part: AttentionSlice,
    num_kv_heads: int,
    group: int,
    hidden_keys: torch.Tensor,
    rows_per_block: int,
    tokens_per_block: int,
) -> DecodePlan:
    device = part.pair_unit.device
    heads = torch.arange(num_kv_heads, device=device)
    pair_token = part.token_index[part.pair_unit, 0]  # [V]
    # Row of (kind, t, kv head) inside a block seen as rows of D: [2, Hkv, T]
    block_rows = (
        torch.arange(2, device=device)[:, None, None] * tokens_per_block * num_kv_heads
        + torch.arange(tokens_per_block, device=device)[None, None, :] * num_kv_heads
        + heads[None, :, None]
    )
    query_rows, row_pairs, row_heads, kv_rows, offsets = [], [], [], [], []
    query_first, kv_first = 0, 0
    for bucket in part.buckets:
        num_items, size = bucket.num_items, bucket.num_shared
        pairs = torch.arange(bucket.first_pair, bucket.first_pair + num_items * size, device=device)
        pairs = pairs.view(num_items, size)  # [n, R]
        query_rows.append((pair_token[pairs][None] * num_kv_heads + heads[:, None, None]).reshape(-1))
        row_shape = (num_kv_heads, num_items, size, group)
        row_pairs.append(pairs[None, :, :, None].expand(row_shape).reshape(-1))
        row_heads.append(heads[:, None, None, None].expand(row_shape).reshape(-1))
        item_pages = part.pair_pages[pairs[:, 0]]  # [n, P]
        # [2, Hkv, n, P, T]: a page's rows, kind by kind, head-major
        rows = item_pages[None, None, :, :, None] * rows_per_block + block_rows[:, :, None, None, :]
        kv_rows.append(rows.flatten(1))
        offsets.append((query_first, query_first * group, kv_first))
        query_first += num_kv_heads * num_items * size
        kv_first += rows[0].numel()
    row_pair, row_head = torch.cat(row_pairs), torch.cat(row_heads)
    row_group = torch.arange(group, device=device).repeat(row_pair.shape[0] // group)
    num_units, num_leaves = part.token_index.shape[0], 1 << (part.num_items - 1).bit_length()
    row_unit_index = part.pair_unit[row_pair]
    row_item = part.pair_slot[row_pair] - row_unit_index * part.num_items
    return DecodePlan(
        query_rows=torch.cat(query_rows),
        kv_rows=torch.cat(kv_rows, dim=1).reshape(-1),
        hidden=hidden_keys[row_pair, 0],
        row_leaf=((row_head * num_units + row_unit_index) * num_leaves + row_item) * group + row_group,
        row_unit=(row_head * num_units + row_unit_index) * group + row_group,
        num_leaves=num_leaves,
        offsets=tuple(offsets),
    )


def kv_rows_view(kv_layer: torch.Tensor) -> torch.Tensor:
    """kv_layer [blocks, 2, T, Hkv, D] (a layer of the pool: blocks a constant stride apart, each
    block's [2, T, Hkv, D] contiguous) seen as rows of D: block b's (kind, t, h) is row
    b * stride(0) / D + (kind T + t) Hkv + h. One index_select of these rows gathers any items
    head-major (measured faster than a gather of whole pages and a per-head view of it)."""
    num_blocks, _, tokens_per_block, num_kv_heads, head_dim = kv_layer.shape
    inner = (2 * tokens_per_block * num_kv_heads * head_dim, tokens_per_block * num_kv_heads * head_dim)
    if (
        kv_layer.stride()[1:] != (inner[1], num_kv_heads * head_dim, head_dim, 1)
        or kv_layer.stride(0) % head_dim
    ):
        raise ValueError(f"kv_layer strides {kv_layer.stride()} are not a pool layer's")
    num_rows = (num_blocks - 1) * (kv_layer.stride(0) // head_dim) + inner[0] // head_dim
    return kv_layer.as_strided((num_rows, head_dim), (head_dim, 1), kv_layer.storage_offset())


def tree_sum(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a pairwise tree whose leaves are the indices along it: appending zeros
    (a longer padded axis) or changing the other axes never changes a result's bits."""
    tensor = tensor.movedim(dim, 0)
    while tensor.shape[0] > 1:
        if tensor.shape[0] % 2:
            tensor = torch.cat((tensor, tensor.new_zeros((1, *tensor.shape[1:]))))
        tensor = tensor[0::2] + tensor[1::2]
    return tensor[0]


def items_bmm(rows: torch.Tensor, items: torch.Tensor, out: torch.Tensor, transpose: bool) -> None:
    """out [B, M, N] = rows [B, M, C] x items [B, C, N] (or x items [B, N, C] transposed, as a view),
    in batched matmuls of exactly ITEMS_PER_CALL items, the last padded with zero items.

    A BLAS picks its kernel and its split by the call's shape, the batch count included: measured
    on an AMD EPYC (MKL, 2 threads), one item's bits changed with the number of items beside it
    (a batch of one is a plain matrix product there, and 8-row items differed between 2 and 5),
    while calls of one fixed count gave every item the same bits wherever it sat and whatever sat
    beside it (tests/unit/test_invariant_decode.py)."""
    num_items = rows.shape[0]
    for first in range(0, num_items, ITEMS_PER_CALL):
        last = min(first + ITEMS_PER_CALL, num_items)
        call_rows, call_items = rows[first:last], items[first:last]
        if last - first < ITEMS_PER_CALL:
            call_rows, call_items = _zero_padded(call_rows), _zero_padded(call_items)
            result = torch.bmm(call_rows, call_items.transpose(1, 2) if transpose else call_items)
            out[first:last] = result[: last - first]
        else:
            torch.bmm(call_rows, call_items.transpose(1, 2) if transpose else call_items, out=out[first:last])


def _zero_padded(batch: torch.Tensor) -> torch.Tensor:
    """batch [b, *] contiguous, zero items appended up to ITEMS_PER_CALL."""
    padding = batch.new_zeros((ITEMS_PER_CALL - batch.shape[0], *batch.shape[1:]))
    return torch.cat((batch, padding))


def decode_attention(
    padded_query: torch.Tensor,
    kv_layer: torch.Tensor,
    part: AttentionSlice,
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """padded_query [N + 1, H, D] in the compute dtype, kv_layer [blocks, 2, T, Hkv, D]; writes the
    slice's tokens' rows of output [N + 1, H, D]. The softmax denominator is a tree sum of the
    weights, item by item, then over items."""
    num_heads, head_dim = padded_query.shape[1:]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    plan = part.plan_for(num_kv_heads, group, sliding_window, kv_layer)
    num_units, num_rows, keys_per_item = part.token_index.shape[0], *plan.hidden.shape
    dtype = padded_query.dtype
    # [S / G, G D]: each pair's query rows, head-major within its bucket
    rows = padded_query.view(-1, group * head_dim).index_select(0, plan.query_rows).mul_(scale)
    key_value = plan.gather_kv(kv_rows_view(kv_layer), dtype)  # [2 Hkv sum(n) K, D]
    num_key_rows = key_value.shape[0] // 2
    scores = rows.new_empty((num_rows, keys_per_item))  # [S, K]
    partial = rows.new_empty((num_rows, head_dim))  # [S, D]

    def bucket_views(
        bucket: DecodeBucket, offsets: tuple[int, int, int], by_row: torch.Tensor, kind: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(by_row's rows [Hkv n, R G, *], the keys or values [Hkv n, K, D]) of one bucket."""
        num_batch, num_bucket_rows = num_kv_heads * bucket.num_items, bucket.num_shared * group
        first_kv = kind * num_key_rows + offsets[2]
        item_rows = by_row[offsets[1] : offsets[1] + num_batch * num_bucket_rows]
        items = key_value[first_kv : first_kv + num_batch * keys_per_item]
        return item_rows.view(num_batch, num_bucket_rows, -1), items.view(num_batch, keys_per_item, head_dim)

    for bucket, offsets in zip(part.buckets, plan.offsets, strict=True):
        num_batch, num_bucket_rows = num_kv_heads * bucket.num_items, bucket.num_shared * group
        bucket_query = rows[offsets[0] : offsets[0] + num_batch * bucket.num_shared]
        bucket_scores, keys = bucket_views(bucket, offsets, scores, 0)
        items_bmm(
            bucket_query.view(num_batch, num_bucket_rows, head_dim), keys, bucket_scores, transpose=True
        )
    scores.masked_fill_(plan.hidden, float("-inf"))
    # The row maximum over a token's pairs (kv head, unit, g): exact in any order.
    leaf_shape = (num_kv_heads, num_units, plan.num_leaves, group)
    unit_max = scores.new_full((num_kv_heads * num_units * group,), float("-inf"))
    unit_max.scatter_reduce_(0, plan.row_unit, scores.amax(dim=-1), "amax")
    weights = scores.sub_(unit_max.index_select(0, plan.row_unit)[:, None]).exp_()  # hidden keys exactly 0
    for bucket, offsets in zip(part.buckets, plan.offsets, strict=True):
        bucket_weights, values = bucket_views(bucket, offsets, weights, 1)
        bucket_partial, _ = bucket_views(bucket, offsets, partial, 1)
        items_bmm(bucket_weights, values, bucket_partial, transpose=False)
    # Numerator and denominator side by side [S, D + 1]: one tree over items sums both (the tree's
    # adds are element-wise, so each column gets the bits of a tree of its own).
    leaves = partial.new_zeros((math.prod(leaf_shape), head_dim + 1))
    # A row's weights are summed over its item's K keys by `sum` over the last axis: a row's bits
    # do not depend on the rows beside it (measured: tests/unit/test_batch_invariance.py); K is
    # fixed, so no padding enters. A tree over the keys took 6 adds and 12 slices a layer.
    leaves[plan.row_leaf] = torch.cat((partial, weights.sum(dim=-1, keepdim=True)), dim=1)
    sums = tree_sum(leaves.view(*leaf_shape, head_dim + 1), dim=2)  # [Hkv, U, G, D + 1]
    unit_output = sums[..., :head_dim] / sums[..., head_dim:]  # [Hkv, U, G, D]
    output[part.token_index[:, 0]] = unit_output.transpose(0, 1).reshape(num_units, num_heads, head_dim)
