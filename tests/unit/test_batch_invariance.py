"""Batch invariance: a token's numbers, and so a request's beams, do not depend on the batch.

Kernel level: invariant_linear's rows, tree_sum and invariant_attention's rows are compared bit
for bit alone and among neighbours (and against the plain kernels with a tolerance). Engine
level: 16 requests of different prompt lengths, widths and shared prefixes join and leave one
batch; each one's token ids and scores equal its run alone in a fresh engine, float32 and float64.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    batch_invariant,
    onednn_calls,
)
from engine.attention import paged_attention, prepare_attention
from engine.batch_invariant import ROW_CHUNK, invariant_linear
from engine.invariant_attention import PAGES_PER_ITEM, PROMPT_UNIT, prepare_invariant_layout, tree_sum
from tests.helpers.checkpoints import write_random_llama_checkpoint
from tests.helpers.onednn_host import onednn_packs

DTYPES = [torch.float32, torch.float64]
LINEAR_PATHS = ["onednn", "onednn-chunks", "columns", "one-matmul", "grouped"]


@pytest.fixture(params=LINEAR_PATHS)
def linear_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The five ways invariant_linear keeps rows apart, where the kernels were measured to allow
    each (this build allows the first four in float32, so the checks must say so): every row in one
    oneDNN call of at least 4 rows (float32; float64 has none and goes on to the next); oneDNN calls
    of the row counts onednn_call_sizes measured (what AMX's bfloat16 kernels allow); prompt rows in one
    padded matmul and decode rows in column groups; every row in one padded matmul but single
    decode rows (a matrix-vector product each); fixed-shape items."""
    if request.param != "onednn":
        monkeypatch.setattr(onednn_calls, "onednn_rows_are_independent", lambda *args: False)
    if request.param not in ("onednn", "onednn-chunks"):
        monkeypatch.setattr(onednn_calls, "onednn_call_sizes", lambda *args: ())
    if request.param not in ("onednn", "onednn-chunks", "columns"):
        monkeypatch.setattr(batch_invariant, "columns_are_independent", lambda *args: False)
    if request.param == "grouped":
        monkeypatch.setattr(batch_invariant, "rows_are_independent", lambda *args: False)
    return str(request.param)


def _rows_agree_wherever_they_sit(linear: Callable[[torch.Tensor], torch.Tensor], in_features: int) -> bool:
    """A wider probe than the engine's checks (another seed, other counts and offsets): every row of
    `linear` over a slice equals that row of `linear` over all 400 rows."""
    rows = torch.randn(400, in_features, generator=torch.Generator().manual_seed(11))
    reference = linear(rows)
    return all(
        torch.equal(linear(rows[offset : offset + count]), reference[offset : offset + count])
        for count, offset in ((4, 1), (8, 50), (20, 7), (28, 300), (48, 91), (128, 200), (300, 60))
    )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16])
def test_the_row_check_tells_the_truth_here(dtype: torch.dtype) -> None:
    """The measurement the one-matmul path rests on, for the shapes of the models tested here. Its
    verdict depends on the host's BLAS (yes on the AMD hosts this was written on, no for float64 on
    an Intel host with AVX-512): where it says yes, a wider probe must agree."""
    for in_features, out_features in ((256, 384), (64, 262), (256, 512), (1024, 2816)):
        if batch_invariant.rows_are_independent(
            in_features, out_features, dtype, "cpu", torch.get_num_threads()
        ):
            weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(5)).to(
                dtype
            )
            assert _rows_agree_wherever_they_sit(
                lambda rows, weight=weight: batch_invariant._padded_matmul(rows.to(dtype), weight),
                in_features,
            ), (in_features, out_features)
    assert not batch_invariant.rows_are_independent(256, 384, dtype, "cuda", 1)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16])
def test_the_item_check_tells_the_truth_here(dtype: torch.dtype) -> None:
    """The grouped path's measurement: where batched items are said to be independent, an item's
    bits are the same in batches of 1 to 16 items; where not, one call per item keeps them."""
    generator = torch.Generator().manual_seed(7)
    for rows_per_item, in_features, out_features in ((1, 256, 384), (4, 256, 384), (16, 64, 262)):
        weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
        items = torch.randn(16, rows_per_item, in_features, generator=generator).to(dtype)
        alone = batch_invariant._item_matmul(items[:1], weight)[0]
        for count in (2, 5, 16):
            assert torch.equal(batch_invariant._item_matmul(items[:count], weight)[0], alone), (
                count,
                rows_per_item,
            )
    assert not batch_invariant.items_are_independent(4, 256, 384, dtype, "cuda", 1)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16])
def test_the_blas_here_keeps_groups_of_four_columns_apart(dtype: torch.dtype) -> None:
    """The measurement the column path rests on, for the shapes of the models tested here."""
    for in_features, out_features in ((256, 384), (64, 262), (256, 512), (1024, 2816), (1024, 32000)):
        assert batch_invariant.columns_are_independent(
            in_features, out_features, dtype, "cpu", torch.get_num_threads()
        )
    assert not batch_invariant.columns_are_independent(256, 384, dtype, "cuda", 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_checks_tell_the_truth_here(dtype: torch.dtype) -> None:
    """The measurements the oneDNN paths rest on, for the shapes of the models tested here: calls
    of ONEDNN_CHUNK_ROWS rows, and of the smaller counts onednn_call_sizes admits, keep rows apart
    everywhere measured; calls of any row count do too in float32 on every host seen so far, and
    in bfloat16 on AVX-512 without AMX, not with AMX's bfloat16 kernels, whose blocking follows
    the row count. Where a check says yes, a wider probe must agree. float64 has no oneDNN inner
    product, so it must go on to the MKL paths."""
    threads = torch.get_num_threads()
    for in_features, out_features in ((256, 384), (64, 262), (256, 512), (1024, 2816), (1024, 32000)):
        shape = (in_features, out_features, dtype, "cpu", threads)
        sizes = onednn_calls.onednn_call_sizes(*shape)
        if not onednn_packs(dtype):  # no inner product in this dtype here: both checks say no
            assert sizes == () and not onednn_calls.onednn_rows_are_independent(*shape)
            continue
        assert sizes[-1] == onednn_calls.ONEDNN_CHUNK_ROWS, (in_features, out_features)
        generator = torch.Generator().manual_seed(5)
        packed = onednn_calls.pack_onednn_weight(
            torch.randn(out_features, in_features, generator=generator).to(dtype)
        )
        assert _rows_agree_wherever_they_sit(
            lambda rows, packed=packed, sizes=sizes: onednn_calls.onednn_chunked(
                rows.to(dtype), packed, sizes
            ),
            in_features,
        ), (in_features, out_features, sizes)
        is_safe = onednn_calls.onednn_rows_are_independent(*shape)
        assert is_safe or dtype != torch.float32, (in_features, out_features)
        if is_safe:
            assert _rows_agree_wherever_they_sit(
                lambda rows, packed=packed: onednn_calls.onednn_inner_product(rows.to(dtype), packed),
                in_features,
            ), (in_features, out_features)
    assert not onednn_calls.onednn_rows_are_independent(256, 384, torch.float64, "cpu", 1)
    assert not onednn_calls.onednn_call_sizes(256, 384, torch.float64, "cpu", 1)
    assert not onednn_calls.onednn_rows_are_independent(256, 384, dtype, "cuda", 1)
    assert not onednn_calls.onednn_call_sizes(256, 384, dtype, "cuda", 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_do_not_depend_on_the_batch(dtype: torch.dtype, linear_path: str) -> None:
    """A decode row (greedy, or one beam of a request) gives the same bits alone, next to other
    requests' beams and singles, and next to prompt rows, wherever it sits."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 256, generator=generator, dtype=dtype)
    row = torch.randn(256, generator=generator, dtype=dtype)
    for width in (1, 2, 4):
        alone_rows = torch.randn(width, 256, generator=generator, dtype=dtype)
        alone_rows[width - 1] = row
        with batch_invariant.row_layout(batch_invariant.make_row_layout([1] * width, [width] * width, "cpu")):
            alone = invariant_linear(alone_rows, weight, None)[width - 1]
        torch.testing.assert_close(alone, torch.nn.functional.linear(row, weight))
        # (rows per sequence, group sizes) of the other sequences, before and after this request's
        for before, after in (
            (([1], [1]), ([], [])),
            (([1, 1, 1, 1], [4, 4, 4, 4]), ([1], [1])),
            (([37], [0]), ([1, 1], [2, 2])),
            (([1, 1, 1], [1, 1, 1]), ([20, 1, 1, 1], [0, 3, 3, 3])),
            (([5, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]), ([1] * 8, [8] * 8)),
        ):
            num_new_tokens = [*before[0], *([1] * width), *after[0]]
            group_sizes = [*before[1], *([width] * width), *after[1]]
            batch = torch.randn(sum(num_new_tokens), 256, generator=generator, dtype=dtype)
            position = sum(before[0]) + width - 1
            batch[position] = row
            layout = batch_invariant.make_row_layout(num_new_tokens, group_sizes, "cpu")
            with batch_invariant.row_layout(layout):
                assert torch.equal(invariant_linear(batch, weight, None)[position], alone), (
                    width,
                    before,
                    after,
                )


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_their_neighbours(dtype: torch.dtype, linear_path: str) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 256, generator=generator, dtype=dtype)
    row = torch.randn(1, 256, generator=generator, dtype=dtype)
    alone = invariant_linear(row, weight, None)[0]
    torch.testing.assert_close(alone, torch.nn.functional.linear(row, weight)[0])
    for num_rows in (2, 3, 13, ROW_CHUNK, ROW_CHUNK + 1, 3 * ROW_CHUNK + 5, 200, 517):
        for position in (0, num_rows // 2, num_rows - 1):
            batch = torch.randn(num_rows, 256, generator=generator, dtype=dtype)
            batch[position] = row[0]
            assert torch.equal(invariant_linear(batch, weight, None)[position], alone), (num_rows, position)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_sum_is_unchanged_by_zero_padding_and_more_rows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    for inner in (1, 3, 8, 96):
        for length in (1, 2, 5, 33):
            values = torch.randn(4, length, inner, generator=generator, dtype=dtype)
            base = tree_sum(values, dim=1)
            torch.testing.assert_close(base, values.sum(dim=1))
            for extra in (1, 6, 40):
                padded = torch.cat((values, torch.zeros(4, extra, inner, dtype=dtype)), dim=1)
                more_rows = torch.cat(
                    (padded, torch.randn(7, length + extra, inner, generator=generator, dtype=dtype))
                )
                assert torch.equal(tree_sum(padded, dim=1), base)
                assert torch.equal(tree_sum(more_rows, dim=1)[:4], base)


def attention_rows(
    seqs: list[tuple[list[int], int, int]],
    is_decode: list[bool] | None,
    query: torch.Tensor,
    kv_layer: torch.Tensor,
) -> torch.Tensor:
    metadata = prepare_attention(seqs, kv_layer.shape[2], "cpu", is_decode)
    return paged_attention(query, kv_layer, metadata, 0.125)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16])
def test_attention_rows_do_not_depend_on_the_batch_or_the_chunking(dtype: torch.dtype) -> None:
    """A 150-token prompt's rows: one pass, chunks that start on and off a 64-token unit boundary
    (as after a reused prefix of 1 or 2 blocks), a chunk that ends mid-unit, and inside a batch
    with other prompts and decode steps give the same bits; they match the padded kernel."""
    generator = torch.Generator().manual_seed(2)
    tokens_per_block, num_heads, num_kv_heads, head_dim = 32, 8, 2, 64
    kv_layer = torch.randn(40, 2, tokens_per_block, num_kv_heads, head_dim, generator=generator).to(dtype)
    prompt_blocks = [3, 7, 1, 12, 30]
    prompt_query = torch.randn(150, num_heads, head_dim, generator=generator).to(dtype)
    whole = attention_rows([(prompt_blocks, 0, 150)], [False], prompt_query, kv_layer)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    plain = attention_rows([(prompt_blocks, 0, 150)], None, prompt_query, kv_layer)
    torch.testing.assert_close(whole, plain, **tolerance)
    for first, count in ((64, 86), (32, 118), (96, 54), (0, 40), (32, 70)):
        # a chunk's pages: only those its tokens reach (the pool's later pages are another's)
        blocks = prompt_blocks[: (first + count - 1) // tokens_per_block + 1]
        chunk = attention_rows(
            [(blocks, first, count)], [False], prompt_query[first : first + count], kv_layer
        )
        assert torch.equal(chunk, whole[first : first + count]), (first, count)
    others = [([5, 6], 0, 40), ([9, 10, 11], 70, 1), ([13], 2, 1), ([20, 21, 22, 23, 24, 25, 26], 0, 200)]
    other_queries = [torch.randn(n, num_heads, head_dim, generator=generator).to(dtype) for _, _, n in others]
    batch = [others[0], others[1], (prompt_blocks, 32, 118), others[2], others[3]]
    decode_flags = [False, True, False, True, False]
    query = torch.cat(
        (other_queries[0], other_queries[1], prompt_query[32:], other_queries[2], other_queries[3])
    )
    rows = attention_rows(batch, decode_flags, query, kv_layer)
    assert torch.equal(rows[41 : 41 + 118], whole[32:])
    # A decode row alone equals the same row in the batch.
    decode_alone = attention_rows([others[1]], [True], other_queries[1], kv_layer)
    assert torch.equal(rows[40:41], decode_alone)


def test_prompt_units_are_aligned_to_positions() -> None:
    """A chunk of positions 96..299 (after a reused prefix of 3 blocks): units 1 to 4, each reading
    keys up to its end; positions before the chunk or past it are padding rows (row N). Its pages
    are those of keys [0, 320), block 0 past the sequence's own."""
    assert PROMPT_UNIT == 64
    layout = prepare_invariant_layout(
        [([4, 5], 0, 1), (list(range(10, 20)), 96, 204)], [True, False], 32, "cpu"
    )
    (prompt,) = layout.prompts
    assert prompt.unit_ends == (128, 192, 256, 320)
    assert prompt.pages.tolist() == list(range(10, 20))
    rows = prompt.token_index.tolist()
    assert rows[0] == [205] * 32 + list(range(1, 33))  # positions 64..95 are cached: padding
    assert rows[3] == list(range(1 + 160, 1 + 204)) + [205] * 20  # positions 300..319 are not here
    short = prepare_invariant_layout([([7], 0, 10)], [False], 32, "cpu")
    assert short.prompts[0].pages.tolist() == [7, 0] and short.prompts[0].unit_ends == (64,)


def test_decode_attention_computes_only_the_items_a_token_can_see() -> None:
    """A decode token (items of 64 keys) at position 9 next to one at 599: 1 + 10 pairs, not 2 x 10.
    The bits equal computing every item (the tests above compare such rows alone and next to
    longer neighbours)."""
    assert PAGES_PER_ITEM == 2
    decode = prepare_invariant_layout([([1], 9, 1), (list(range(2, 21)), 599, 1)], [True, True], 32, "cpu")
    (part,) = decode.slices
    assert part.num_items == 10 and part.pair_unit.tolist() == [0] + [1] * 10
    assert part.pair_pages[0].tolist() == [1, 0] and part.pair_pages[-1].tolist() == [20, 0]
    assert part.hidden_keys[0, 0].tolist() == [k > 9 for k in range(64)]
    assert part.hidden_keys[-1, 0].tolist() == [k > 599 - 576 for k in range(64)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_beams_of_one_request_read_shared_pages_once_whatever_the_batch(dtype: torch.dtype) -> None:
    """Request A's 3 beams at position 300 share their first 9 pages (items 0 to 3, and page 8 of
    item 4) and each has its own last page; request B's 2 beams hold the very same pages (a
    reused prefix). A's shared items are read once for its 3 beams (buckets of R = 3, and R = 1
    for the items its beams do not share), never merged with B's: A's rows, and B's, have the
    same bits alone and together, and equal attention computed beam by beam within a tolerance."""
    generator = torch.Generator().manual_seed(5)
    tokens_per_block, num_heads, num_kv_heads, head_dim = 32, 8, 2, 64
    kv_layer = torch.randn(40, 2, tokens_per_block, num_kv_heads, head_dim, generator=generator).to(dtype)
    shared = list(range(1, 10))
    beams_a = [(shared + [20 + beam], 300, 1) for beam in range(3)]
    beams_b = [(shared + [20 + beam], 300, 1) for beam in range(2)]
    query = torch.randn(5, num_heads, head_dim, generator=generator).to(dtype)

    def rows(
        seqs: list[tuple[list[int], int, int]], groups: list[int], rows_query: torch.Tensor
    ) -> torch.Tensor:
        metadata = prepare_attention(seqs, tokens_per_block, "cpu", [True] * len(seqs), groups)
        return paged_attention(rows_query, kv_layer, metadata, 0.125)

    alone_a = rows(beams_a, [3, 3, 3], query[:3])
    alone_b = rows(beams_b, [2, 2], query[3:])
    together = rows(beams_a + beams_b, [3, 3, 3, 2, 2], query)
    assert torch.equal(together[:3], alone_a) and torch.equal(together[3:], alone_b)
    beam_by_beam = rows(beams_a, [1, 1, 1], query[:3])
    torch.testing.assert_close(alone_a, beam_by_beam)
    layout = prepare_invariant_layout(beams_a + beams_b, [True] * 5, tokens_per_block, "cpu", [3, 3, 3, 2, 2])
    (part,) = layout.slices
    # A: items 0 to 3 shared by 3 (R = 3), item 4 per beam (R = 1); B: items 0 to 3 by 2, item 4 per beam.
    assert sorted(tuple(members.shape) for members in part.shared) == [(4, 2), (4, 3), (5, 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough (hidden 256, GQA 8/2) that the plain kernels' shapes change the bits."""
    return write_random_llama_checkpoint(
        tmp_path_factory.mktemp("llama-256"),
        num_heads=8,
        num_kv_heads=2,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        max_position_embeddings=2048,
    )


def make_engine(model_dir: Path, dtype: str) -> LLMEngine:
    cache = CacheConfig(tokens_per_block=32, num_blocks=512)
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, cache=cache, batch_invariant=True))


def mixed_requests() -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(3)
    common = [rng.randrange(5, 500) for _ in range(70)]  # 2 full blocks shared by a third of them
    requests = []
    for index in range(16):
        length = [5, 33, 64, 100, 17, 250, 40, 8][index % 8]
        prompt = [rng.randrange(5, 500) for _ in range(length)]
        if index % 3 == 0:
            prompt = common + prompt
        params = SamplingParams(
            beam_width=[1, 2, 4, 3][index % 4], max_new_tokens=6 + index % 5, ignore_eos=True
        )
        requests.append((f"r{index}", prompt, params))
    return requests


def beams_of(output: RequestOutput) -> list[tuple[list[int], float, float]]:
    assert output.error is None, output.error
    return [(beam.token_ids, beam.score, beam.cumulative_logprob) for beam in output.beams]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_requests_in_a_changing_batch_equal_their_runs_alone(
    model_dir: Path, dtype: str, linear_path: str
) -> None:
    """bfloat16 on the oneDNN paths only (what serves it; on an AMX host both are the call-size
    path, whose decode and prompt rows take calls of different sizes)."""
    if dtype == "bfloat16" and not linear_path.startswith("onednn"):
        pytest.skip("bfloat16 is served by the oneDNN paths")
    requests = mixed_requests()
    alone = {
        request_id: beams_of(make_engine(model_dir, dtype).generate(prompt, params))
        for request_id, prompt, params in requests
    }
    engine = make_engine(model_dir, dtype)
    together: dict[str, list[tuple[list[int], float, float]]] = {}
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_row_sums_over_the_last_axis_do_not_depend_on_the_rows_beside(
    dtype: torch.dtype, num_threads: int
) -> None:
    """The decode kernel sums each score row's weights over its item's K keys with `sum` over the
    last axis: a row gives the bits it gives alone, whatever the row count and the rows' place in
    the buffer (a bucket's rows start anywhere in the step's scores)."""
    generator = torch.Generator().manual_seed(5)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for keys in (32, 64, 128):
            # Weights as the kernel makes them: exp of scores minus a maximum, some exactly 0
            rows = torch.randn(3000, keys, generator=generator, dtype=dtype).mul_(4).exp_()
            rows[rows < 0.05] = 0
            alone = torch.stack([rows[index : index + 1].sum(dim=-1)[0] for index in range(0, 3000, 61)])
            for first, count in ((0, 1), (0, 9), (5, 36), (61, 200), (3, 1700), (0, 3000)):
                sums = rows[first : first + count].sum(dim=-1)
                picked = [index for index in range(0, 3000, 61) if first <= index < first + count]
                assert torch.equal(
                    sums[[index - first for index in picked]], alone[[index // 61 for index in picked]]
                ), (keys, first, count)
    finally:
        torch.set_num_threads(previous)
