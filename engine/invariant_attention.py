"""Batch-invariant attention over the paged pool: a token's output does not depend on the batch.

Attention over a padded batch picks its kernels from the batch twice: the score matmul's blocking
follows the longest key length, and so does the P @ V reduction. Here every call's shapes follow
from a token's role and position alone (the measured facts about matmuls are in
engine/batch_invariant.py):
- prompt tokens: in units of PROMPT_UNIT aligned to positions; unit k holds the queries of
  positions [64 k, 64 k + 64) (those not in this pass are padding rows) and reads keys
  [0, 64 k + 64) from one gathered copy of its sequence's pages. Its two matmuls, scores
  [Hkv, 64 G, D] x [Hkv, D, 64 k + 64], a softmax over each row, and P @ V
  [Hkv, 64 G, 64 k + 64] x [Hkv, 64 k + 64, D], have shapes and strides that follow from k
  alone, so a prompt token computed whole, in a chunk that starts on or off a unit boundary,
  after a reused prefix or next to other prompts gives the same bits. Keys past a row's
  position are masked to -inf before the softmax.
- decode tokens (engine/invariant_decode.py): a decode token alone (G rows per kv head) against
  items of PAGES_PER_ITEM pages, each item's keys and values copied once; scores [R G, D] x
  [D, K] and P @ V [R G, K] x [K, D] are fixed-shape items (strides that are constants) of one
  batched matmul per bucket of R, the beams of one request that read the same item; items and
  the softmax denominators are summed by a pairwise tree with a fixed leaf per item.

- with the compiled kernel (engine/native/kernels.cpp, the default on a CPU): every token, prompt
  or decode, is a unit of its own, its keys [0, position] read from its pages; its bits are those
  of a decode token at its position. The two forms above run where the kernel does not
  (`--no-native-kernels`, no compiler).

A sliding-window layer (window W) hides, in both paths, the keys at or before position - W as well;
the hidden keys follow from a token's position and W alone, so invariance holds there too.

The cost is up to 63 padding query rows per prompt sequence and pass, and smaller matmuls for
decode; `bench invariance` measures it. See docs/engine.md, "Batch invariance".

Dimensions: N new tokens, U query units, Q tokens per unit, P pages, T tokens per page, H query
heads, Hkv kv heads, G = H / Hkv, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.invariant_decode import PAGES_PER_ITEM, AttentionSlice, decode_attention, make_slice, tree_sum
from engine.kv_pool import KEY, VALUE
from engine.native_kernels import decode_kernel

__all__ = [
    "PAGES_PER_ITEM",
    "PROMPT_UNIT",
    "AttentionSlice",
    "InvariantLayout",
    "NativeDecode",
    "PromptSequence",
    "invariant_attention",
    "prepare_invariant_layout",
    "tree_sum",
]

PROMPT_UNIT = 64  # prompt queries per attention unit, aligned to positions (unit k: [64 k, 64 k + 64))
MAX_DECODE_ITEMS = 16384


@dataclass(frozen=True)
class PromptSequence:
    """One sequence's prompt tokens in a forward pass, in units aligned to positions: unit k holds
    the queries of positions [k * PROMPT_UNIT, (k + 1) * PROMPT_UNIT) and reads keys
    [0, (k + 1) * PROMPT_UNIT). Every shape a prompt token meets is a function of its position."""

    pages: torch.Tensor  # [P] pages of keys [0, the last unit's end) (block 0 past the sequence's own)
    unit_ends: tuple[int, ...]  # (k + 1) * PROMPT_UNIT for each unit, in order
    token_index: torch.Tensor  # [units, PROMPT_UNIT] new-token row of each position; N if not new


@dataclass(frozen=True)
class NativeDecode:
    """Tokens for the compiled kernel (engine/native/kernels.cpp), decode tokens and prompt tokens
    alike: each token's row, position and pages; the kernel computes each token alone, in one
    order, so a prompt token's bits are those of a decode token at its position."""

    token_index: torch.Tensor  # [U] the token's row among the N new tokens
    positions: torch.Tensor  # [U] its position: it reads keys [0, position], its own included
    block_table: torch.Tensor  # [U, P] its pages (block 0 past its own)


@dataclass(frozen=True)
class InvariantLayout:
    slices: tuple[AttentionSlice, ...]  # decode tokens (torch ops)
    prompts: tuple[PromptSequence, ...] = ()
    native: NativeDecode | None = None  # all tokens (the compiled kernel), in place of both


def prepare_invariant_layout(
    seqs: Sequence[tuple[Sequence[int], int, int]],
    is_decode: Sequence[bool],
    tokens_per_block: int,
    device: torch.device | str,
    beam_group_sizes: Sequence[int] | None = None,
    sliding_windows: Sequence[int] = (),
    native_attention: bool = False,
) -> InvariantLayout:
    """seqs: (block_ids, num_cached_tokens, num_new_tokens) in batch order, as prepare_attention;
    beam_group_sizes: per decode sequence the W of its request, whose W beams are consecutive
    (None: each decode sequence is a request of its own); sliding_windows: the model's windows;
    native_attention: every token, decode or prompt, goes to the compiled kernel
    (engine/native_kernels.py) instead of torch ops."""
    num_tokens = sum(num_new for _, _, num_new in seqs)
    # Per request, (token index, position, block ids) of each decoding beam
    decode_groups: list[list[tuple[int, int, Sequence[int]]]] = []
    prompts: list[PromptSequence] = []
    # The compiled kernel's prompt tokens: (first token index, first position, count, block ids)
    native_prompts: list[tuple[int, int, int, Sequence[int]]] = []
    start, group_end = 0, 0
    for index, ((block_ids, num_cached, num_new), decode) in enumerate(zip(seqs, is_decode, strict=True)):
        if decode:
            if num_new != 1:
                raise ValueError(f"a decode sequence feeds one token, got {num_new}")
            if index >= group_end:
                decode_groups.append([])
                group_end = index + (1 if beam_group_sizes is None else max(1, beam_group_sizes[index]))
            decode_groups[-1].append((start, num_cached, block_ids[: num_cached // tokens_per_block + 1]))
        elif native_attention:
            last_page = (num_cached + num_new - 1) // tokens_per_block
            native_prompts.append((start, num_cached, num_new, block_ids[: last_page + 1]))
        else:
            prompts.append(
                _prompt_sequence(block_ids, num_cached, num_new, start, num_tokens, tokens_per_block, device)
            )
        start += num_new
    if native_attention:
        decode_units = [unit for group in decode_groups for unit in group]
        return InvariantLayout((), (), _native_units(decode_units, native_prompts, device))
    # Slices bound the memory; a request's beams always stay in one slice.
    slices: list[AttentionSlice] = []
    current: list[list[tuple[int, int, Sequence[int]]]] = []
    num_units, max_pages = 0, 0
    for group in decode_groups:
        pages = max(len(beam[2]) for beam in group)
        if current and (num_units + len(group)) * max(max_pages, pages) > MAX_DECODE_ITEMS:
            slices.append(make_slice(current, max_pages, tokens_per_block, device, sliding_windows))
            current, num_units, max_pages = [], 0, 0
        current.append(group)
        num_units, max_pages = num_units + len(group), max(max_pages, pages)
    if current:
        slices.append(make_slice(current, max_pages, tokens_per_block, device, sliding_windows))
    return InvariantLayout(tuple(slices), tuple(prompts))


def _native_units(
    decode_units: Sequence[tuple[int, int, Sequence[int]]],
    prompts: Sequence[tuple[int, int, int, Sequence[int]]],
    device: torch.device | str,
) -> NativeDecode | None:
    """The compiled kernel's units: each decode token (token index, position, pages), then each
    prompt token at its own position; a prompt's tokens share its block-table row (a token reads
    only the pages up to its position)."""
    if not decode_units and not prompts:
        return None
    rows = [pages for _, _, pages in decode_units] + [pages for *_, pages in prompts]
    max_pages = max(len(pages) for pages in rows)
    table = torch.tensor([list(pages) + [0] * (max_pages - len(pages)) for pages in rows], dtype=torch.long)
    counts = [1] * len(decode_units) + [count for _, _, count, _ in prompts]
    token_index = [token for token, _, _ in decode_units]
    positions = [position for _, position, _ in decode_units]
    for first_token, first_position, count, _ in prompts:
        token_index.extend(range(first_token, first_token + count))
        positions.extend(range(first_position, first_position + count))
    return NativeDecode(
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        block_table=table.repeat_interleave(torch.tensor(counts), dim=0).to(device),
    )


def _prompt_sequence(
    block_ids: Sequence[int],
    num_cached: int,
    num_new: int,
    start: int,
    num_tokens: int,
    tokens_per_block: int,
    device: torch.device | str,
) -> PromptSequence:
    first_unit, last_unit = num_cached // PROMPT_UNIT, (num_cached + num_new - 1) // PROMPT_UNIT
    unit_ends = tuple((unit + 1) * PROMPT_UNIT for unit in range(first_unit, last_unit + 1))
    # Keys up to the last unit's end; the pages past the sequence's own hold keys that only
    # positions past its new tokens could see (masked for every real row).
    num_pages = -(-unit_ends[-1] // tokens_per_block)
    pages = list(block_ids[:num_pages]) + [0] * max(0, num_pages - len(block_ids))
    token_index = [
        [
            start + position - num_cached if num_cached <= position < num_cached + num_new else num_tokens
            for position in range(end - PROMPT_UNIT, end)
        ]
        for end in unit_ends
    ]
    return PromptSequence(
        pages=torch.tensor(pages, dtype=torch.long, device=device),
        unit_ends=unit_ends,
        token_index=torch.tensor(token_index, dtype=torch.long, device=device),
    )


def invariant_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    layout: InvariantLayout,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [N, H, D] (rotary applied), kv_layer [blocks, 2, T, Hkv, D] holding the new tokens'
    K/V -> [N, H, D]; see the module docstring for why every shape is fixed."""
    num_tokens, num_heads, head_dim = query.shape
    if (
        layout.native is not None
        and not (layout.slices or layout.prompts)
        and query.dtype == kv_layer.dtype
        and query.dtype in _NATIVE_QUERY_DTYPES
    ):
        # Only the compiled kernel: it takes the query and writes the output in the pool's dtype
        # (bfloat16 computes in float32 inside and rounds as .to() does: the same bits, without
        # the two conversions)
        output = torch.empty_like(query, memory_format=torch.contiguous_format)
        _native_attention(query.contiguous(), kv_layer, layout.native, scale, sliding_window, output)
        return output
    # Half-precision queries compute in float32 (see _compute_dtype); the pages are cast as gathered.
    compute_query = query.to(_compute_dtype(query.dtype))
    # Row N: padding, which only prompt units read (decode tokens index their own rows).
    padded_query = compute_query.contiguous()
    if layout.prompts:
        padded_query = torch.cat((padded_query, padded_query.new_zeros((1, num_heads, head_dim))))
    output = padded_query.new_empty((num_tokens + 1, num_heads, head_dim))
    if layout.native is not None:
        _native_attention(padded_query, kv_layer, layout.native, scale, sliding_window, output)
    for part in layout.slices:
        decode_attention(padded_query, kv_layer, part, scale, output, sliding_window)
    for prompt in layout.prompts:
        _prompt_attention(padded_query, kv_layer, prompt, scale, output, sliding_window)
    return output[:num_tokens].to(query.dtype)


# Query dtypes the compiled kernel takes as they are, with a pool of the same dtype (a float16
# pool's queries go in as float32: engine/native/kernels.cpp's decode_attention)
_NATIVE_QUERY_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _native_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    native: NativeDecode,
    scale: float,
    sliding_window: int | None,
    output: torch.Tensor,
) -> None:
    """The compiled kernel's rows of `output` (engine/native/kernels.cpp)."""
    kernel = decode_kernel()
    if kernel is None:
        raise RuntimeError("a native decode layout, but the native decode kernel is not loaded")
    kernel(query, kv_layer, native.token_index, native.positions, native.block_table, scale, sliding_window or 0,
           output)  # fmt: skip


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bfloat16 (and float16) attention runs in float32: torch's CPU bmm has no fast kernel for
    these items in bfloat16 (strided [K, D] page views took 1.3 ms per call against 0.017 ms in
    float32, the P @ V product 2.4 ms against 0.010: a decode step of the 135M model spent most of
    its time there), and the float32 kernels are the ones measured batch invariant. The pages
    stay bfloat16 in the pool (half the memory); only the gathered copies are float32."""
    return torch.promote_types(dtype, torch.float32)


def _gather_pages(kv_layer: torch.Tensor, kind: int, pages: torch.Tensor) -> torch.Tensor:
    """kv_layer [blocks, 2, T, Hkv, D], pages [...] -> the pages' keys (kind KEY) or values
    [..., T, Hkv, D], copied. A page is one row of kv_layer[:, kind] seen as [blocks, T Hkv D];
    index_select copies whole rows, measured about a fifth faster than advanced indexing."""
    rows = kv_layer[:, kind].flatten(1).index_select(0, pages.reshape(-1))
    rows = rows.to(_compute_dtype(rows.dtype))  # a no-op in float32 and float64
    return rows.view(*pages.shape, *kv_layer.shape[2:])


def _prompt_attention(
    padded_query: torch.Tensor,
    kv_layer: torch.Tensor,
    prompt: PromptSequence,
    scale: float,
    output: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """Unit by unit: scores [Hkv, Q G, end], softmax, and P @ V [Hkv, Q G, end] x [Hkv, end, D], where
    end = (k + 1) * Q for unit k. The keys and values are one gathered copy of the sequence's
    pages whose strides do not depend on its length, so a unit's matmuls are the same calls
    whatever else is in the pass (an earlier chunk, a reused prefix, other prompts)."""
    num_heads, head_dim = padded_query.shape[1:]
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    dtype, softmax_dtype = padded_query.dtype, _compute_dtype(padded_query.dtype)
    keys = _gather_pages(kv_layer, KEY, prompt.pages).flatten(0, 1)  # [P T, Hkv, D] in position order
    values = _gather_pages(kv_layer, VALUE, prompt.pages).flatten(0, 1)
    offsets = torch.arange(PROMPT_UNIT, device=padded_query.device)
    causal = (offsets[None, :] > offsets[:, None])[:, None, :]  # [Q, 1, Q]: key past the query's position
    for end, token_index in zip(prompt.unit_ends, prompt.token_index, strict=True):
        unit_query = (padded_query[token_index] * scale).view(PROMPT_UNIT, num_kv_heads, group, head_dim)
        unit_query = unit_query.transpose(0, 1).reshape(num_kv_heads, PROMPT_UNIT * group, head_dim)
        scores = torch.bmm(unit_query, keys[:end].permute(1, 2, 0))  # [Hkv, Q G, end]
        scores.view(num_kv_heads, PROMPT_UNIT, group, end)[..., end - PROMPT_UNIT :].masked_fill_(
            causal, float("-inf")
        )
        if sliding_window is not None:
            # Keys at or before position - W: a function of the unit (its end) and W alone.
            query_positions = torch.arange(end - PROMPT_UNIT, end, device=padded_query.device)
            key_positions = torch.arange(end, device=padded_query.device)
            out_of_window = key_positions[None, :] <= query_positions[:, None] - sliding_window  # [Q, end]
            scores.view(num_kv_heads, PROMPT_UNIT, group, end).masked_fill_(
                out_of_window[:, None, :], float("-inf")
            )
        # One fused pass per row (maximum, exp, sum, scale); hidden keys weigh exactly 0.
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(dtype)
        unit_output = torch.bmm(probs, values[:end].transpose(0, 1))  # [Hkv, Q G, D]
        output[token_index] = (
            unit_output.view(num_kv_heads, PROMPT_UNIT, group, head_dim)
            .transpose(0, 1)
            .reshape(PROMPT_UNIT, num_heads, head_dim)
        )
