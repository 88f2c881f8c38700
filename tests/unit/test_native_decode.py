"""The compiled kernels (engine/native/kernels.cpp, issue 29): decode attention as the torch form
computes it, a token's bits whatever else is in the call and however many threads run it, bad
layouts refused by name, RMSNorm row by row, and a build that falls back instead of failing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import native_kernels
from engine.attention import paged_attention, prepare_attention, write_kv
from engine.models.decoder import RotaryEmbedding, apply_rotary_table, rotary_table
from engine.models.norms import RMSNorm, use_native_norms
from engine.models.q8_embedding import same_bits

pytestmark = pytest.mark.skipif(native_kernels.decode_kernel() is None, reason="no C++ compiler here")

Seq = tuple[list[int], int, int]


def rows(
    seqs: list[Seq],
    groups: list[int],
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    native: bool,
    window: int | None,
) -> torch.Tensor:
    metadata = prepare_attention(
        seqs, kv_layer.shape[2], "cpu", [True] * len(seqs), groups, (window,) if window else (), native
    )
    assert (metadata.invariant is not None) and ((metadata.invariant.native is not None) == native)
    return paged_attention(query, kv_layer, metadata, 0.125, window)


def batch(tokens_per_block: int) -> tuple[list[Seq], list[int]]:
    """A request of 4 beams at position 300 sharing their prompt pages, one at 40 across a page
    boundary, one at position 0, one whose last page is its first key of the page."""
    shared = list(range(1, 300 // tokens_per_block + 1))
    beams = [(shared + [40 + beam], 300, 1) for beam in range(4)]
    last = 2 * tokens_per_block
    return beams + [
        ([30, 31, 32][: 40 // tokens_per_block + 1], 40, 1),
        ([35], 0, 1),
        ([36, 37, 38], last, 1),
    ], [4, 4, 4, 4, 1, 1, 1]


@pytest.mark.parametrize("head_dim", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)],
)
def test_the_kernel_computes_the_torch_forms_attention(
    head_dim: int, window: int | None, dtype: torch.dtype, tolerance: float
) -> None:
    """Against engine/invariant_decode.py (every head dim path: 64, 128 and 256 are whole vectors the
    compiler knows, 8 and 80 the zero-padded general path), GQA 9/3, pages of 32."""
    generator = torch.Generator().manual_seed(head_dim)
    seqs, groups = batch(32)
    kv_layer = torch.randn(50, 2, 32, 3, head_dim, generator=generator).to(dtype)
    query = torch.randn(len(seqs), 9, head_dim, generator=generator).to(dtype)
    expected = rows(seqs, groups, query, kv_layer, False, window)
    got = rows(seqs, groups, query, kv_layer, True, window)
    torch.testing.assert_close(got.double(), expected.double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_tokens_bits_do_not_depend_on_the_call_or_the_threads(dtype: torch.dtype) -> None:
    """Each token alone, in the whole batch, in the batch reversed, at 1 and 2 threads: the same bits.
    The batch's items take a token's kv heads together, a lone token's one head each (kernels.cpp)."""
    generator = torch.Generator().manual_seed(3)
    seqs, groups = batch(16)
    kv_layer = torch.randn(60, 2, 16, 2, 64, generator=generator).to(dtype)
    query = torch.randn(len(seqs), 8, 64, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = rows(seqs, groups, query, kv_layer, True, None)
        reverse = list(reversed(range(len(seqs))))
        reversed_rows = rows(
            [seqs[i] for i in reverse], [1] * len(seqs), query[reverse], kv_layer, True, None
        )
        torch.set_num_threads(1)
        for index, seq in enumerate(seqs):
            alone = rows([seq], [1], query[index : index + 1], kv_layer, True, None)
            assert same_bits(alone, together[index : index + 1]), index
            assert same_bits(alone, reversed_rows[len(seqs) - 1 - index : len(seqs) - index]), index
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_a_prompt_tokens_bits_are_a_decode_tokens_at_its_position(
    dtype: torch.dtype, tolerance: float
) -> None:
    """Prompt tokens are units of the kernel too: a chunk of 70 prompt tokens after 30 cached ones,
    beside a decode token, gives each token the bits of a decode token alone at its position, and
    the values of the torch form's prompt units."""
    generator = torch.Generator().manual_seed(5)
    kv_layer = torch.randn(20, 2, 16, 3, 64, generator=generator).to(dtype)
    pages = list(range(1, 8))  # positions [0, 112), pages of 16
    query = torch.randn(71, 9, 64, generator=generator).to(dtype)
    seqs = [([10, 11, 12], 40, 1), (pages, 30, 70)]

    def batch(native: bool) -> torch.Tensor:
        metadata = prepare_attention(seqs, 16, "cpu", [True, False], [1, 1], (), native)
        return paged_attention(query, kv_layer, metadata, 0.125, None)

    together = batch(True)
    torch.testing.assert_close(together.double(), batch(False).double(), atol=tolerance, rtol=tolerance)
    assert same_bits(together[:1], rows([seqs[0]], [1], query[:1], kv_layer, True, None))
    for index in range(70):
        position = 30 + index
        alone = rows(
            [(pages[: position // 16 + 1], position, 1)],
            [1],
            query[1 + index : 2 + index],
            kv_layer,
            True,
            None,
        )
        assert same_bits(alone, together[1 + index : 2 + index]), position


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_a_bfloat16_pool_is_the_float32_dot_product_of_its_values(head_dim: int) -> None:
    """A bfloat16 pool's scores (with AVX512-BF16, by bfloat16 dot-product instructions on the
    pages' own bits where the head dim is whole 32-value vectors: 64 and 128 here; 80 widens each
    value first) are the float32 sums of the same values in another order: equal to the kernel's
    output over a float32 copy of the pool to float32 rounding, not bfloat16's. Given bfloat16
    queries it writes bfloat16 rows, those of the float32 output rounded."""
    generator = torch.Generator().manual_seed(head_dim)
    seqs, groups = batch(32)
    kv_layer = torch.randn(50, 2, 32, 3, head_dim, generator=generator).to(torch.bfloat16)
    query = torch.randn(len(seqs), 9, head_dim, generator=generator).to(torch.bfloat16)
    wide = rows(seqs, groups, query.float(), kv_layer.float(), True, None)
    kernel = native_kernels.decode_kernel()
    assert kernel is not None
    output = torch.empty(len(seqs), 9, head_dim)
    metadata = prepare_attention(seqs, 32, "cpu", [True] * len(seqs), groups, (), True)
    assert metadata.invariant is not None and metadata.invariant.native is not None
    native = metadata.invariant.native
    kernel(
        query.float(), kv_layer, native.token_index, native.positions, native.block_table, 0.125, 0, output
    )
    torch.testing.assert_close(output, wide, atol=2e-6, rtol=2e-6)
    # bfloat16 queries in, bfloat16 out (what invariant_attention passes): the float32 call's bits, rounded
    direct = torch.empty(len(seqs), 9, head_dim, dtype=torch.bfloat16)
    kernel(query, kv_layer, native.token_index, native.positions, native.block_table, 0.125, 0, direct)
    assert same_bits(direct, output.to(torch.bfloat16))
    assert same_bits(rows(seqs, groups, query, kv_layer, True, None), direct)
    if head_dim % 32 == 0 and "avx512_bf16" in native_kernels._cpu_flags().split():
        off_grid = query.float() + 1e-3  # no longer bfloat16 values: their pairs would round them
        with pytest.raises(RuntimeError, match="a bfloat16 pool's queries must be bfloat16 values"):
            kernel(
                off_grid, kv_layer, native.token_index, native.positions, native.block_table, 0.125, 0, output
            )


def test_bad_layouts_are_refused_by_name() -> None:
    kernel = native_kernels.decode_kernel()
    assert kernel is not None
    kv_layer = torch.randn(4, 2, 16, 2, 64)
    query, output = torch.randn(3, 4, 64), torch.empty(3, 4, 64)
    token_index, positions = torch.tensor([0, 1]), torch.tensor([5, 20])
    table = torch.tensor([[1, 2], [3, 0]])
    kernel(query, kv_layer, token_index, positions, table, 0.125, 0, output)  # a valid call
    cases = [
        (
            (query, kv_layer, token_index, positions, torch.tensor([[1, 2], [3, 9]])),
            "block id 9 out of the pool",
        ),
        (
            (query, kv_layer, token_index, torch.tensor([5, 32]), table),
            "position 32 past its block-table row",
        ),
        ((query, kv_layer, torch.tensor([0, 3]), positions, table), "token index 3 out of range"),
        ((query.to(torch.float64), kv_layer, token_index, positions, table), "output must match query"),
        (
            (torch.randn(3, 64, 4).transpose(1, 2), kv_layer, token_index, positions, table),
            "query rows must be contiguous",
        ),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernel(*args, 0.125, 0, output)


def test_a_build_is_cached_and_a_missing_compiler_is_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library lands in the cache folder once (a second load does not rebuild it); with no
    compiler `_build` raises a reason, which decode_kernel logs before the engine falls back."""
    monkeypatch.setenv(native_kernels.CACHE_ENV, str(tmp_path))
    built = native_kernels._build(native_kernels.SOURCE)
    assert built.parent.parent == tmp_path and built.exists()
    stamp = built.stat().st_mtime_ns
    assert native_kernels._build(native_kernels.SOURCE) == built and built.stat().st_mtime_ns == stamp
    assert [path.name for path in built.parent.iterdir()] == [built.name]  # no partial files left
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises((OSError, RuntimeError)):
        native_kernels._build(native_kernels.SOURCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_are_their_own_and_the_torch_forms(dtype: torch.dtype) -> None:
    """The compiled RMSNorm: within an ulp or two of the torch form, each row's bits alone and
    among 63 others, and in a non-contiguous view (a batch's q of a fused projection, where a lone
    row's view is contiguous); float64 keeps the torch form."""
    kernel = native_kernels.norm_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(7)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=generator)
    norm = norm.to(dtype)
    hidden = (torch.randn(64, 576, generator=generator) * 3).to(dtype)
    expected = norm(hidden)
    use_native_norms(norm, kernel)
    got = norm(hidden)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=1e-5)
    fused = torch.cat((hidden, torch.zeros_like(hidden)), dim=1)  # [64, 2 x 576]: rows 1152 apart
    assert not fused[:, :576].is_contiguous() and fused[:1, :576].is_contiguous()
    assert same_bits(norm(fused[:, :576]), got)
    for index in (0, 17, 63):
        assert same_bits(norm(fused[index : index + 1, :576]), got[index : index + 1])
    calls: list[int] = []
    norm.native = lambda *args: calls.append(1) or kernel(*args)
    norm.double()(hidden.double())
    assert calls == []
    norm.to(dtype)(hidden)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_rotary_write_is_the_torch_ops_bit_for_bit(dtype: torch.dtype, num_tokens: int) -> None:
    """The compiled rotary and K/V write (engine/models/decoder.py, Attention.forward's fused path):
    the rotated queries and every page of the pool equal apply_rotary_table then write_kv's."""
    heads, kv_heads, dim = 9, 3, 64
    generator = torch.Generator().manual_seed(num_tokens)
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=generator) * 3).to(dtype)
    positions = torch.randint(0, 8000, (num_tokens,), generator=generator)
    cos, sin = rotary_table(*RotaryEmbedding(dim, 10000.0)(positions, dtype))
    slots = torch.randperm(40 * 16, generator=generator)[:num_tokens]
    metadata = SimpleNamespace(slot_blocks=slots // 16, slot_offsets=slots % 16)
    expected_pool = torch.randn(40, 2, 16, kv_heads, dim, generator=generator).to(dtype)
    pool = expected_pool.clone()

    query, key, value = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    rotated = apply_rotary_table(qkv[:, : (heads + kv_heads) * dim].view(num_tokens, -1, dim), cos, sin)
    write_kv(expected_pool, rotated[:, heads:], value.reshape(num_tokens, kv_heads, dim), metadata)  # type: ignore[arg-type]
    kernel = native_kernels.rotary_kernel()
    assert kernel is not None
    got = kernel(qkv, heads, cos.reshape(num_tokens, dim), sin.reshape(num_tokens, dim), pool,
                 metadata.slot_blocks, metadata.slot_offsets)  # fmt: skip
    assert same_bits(got, rotated[:, :heads]) and same_bits(pool, expected_pool)
    with pytest.raises(RuntimeError, match="out of the pool"):
        kernel(qkv, heads, cos.reshape(num_tokens, dim), sin.reshape(num_tokens, dim), pool,
               metadata.slot_blocks + 40, metadata.slot_offsets)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(dtype: torch.dtype) -> None:
    """The residual add fused with the norm after it: the sum is torch's add and the norm the
    compiled rms_norm of that sum, for 1 row and 64, each row's bits its own; bad operands refused."""
    add_kernel, kernel = native_kernels.add_norm_kernel(), native_kernels.norm_kernel()
    assert add_kernel is not None and kernel is not None
    generator = torch.Generator().manual_seed(11)
    residual, delta = ((torch.randn(64, 576, generator=generator) * 3).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=generator).to(dtype)
    summed, normed = add_kernel(residual, delta, weight, 1e-5)
    assert same_bits(summed, residual + delta) and same_bits(normed, kernel(residual + delta, weight, 1e-5))
    for index in (0, 31, 63):
        row_sum, row_norm = add_kernel(residual[index : index + 1], delta[index : index + 1], weight, 1e-5)
        assert same_bits(row_sum, summed[index : index + 1]) and same_bits(
            row_norm, normed[index : index + 1]
        )
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = weight
    use_native_norms(norm, kernel, add_kernel)
    via_module = norm.add_and_norm(residual, delta)
    assert same_bits(via_module[0], summed) and same_bits(via_module[1], normed)
    with pytest.raises(RuntimeError, match="delta must be contiguous"):
        add_kernel(residual, delta[:, :288], weight, 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        add_kernel(residual, delta, weight.double(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 4, 64])
def test_silu_mul_is_torchs_silu_times_up_bit_for_bit(dtype: torch.dtype, num_rows: int) -> None:
    """The gated MLP's split, SiLU and product in one call: torch's own bits (its silu kernel on
    the gate's view, the product rounded as torch's mul rounds it)."""
    kernel = native_kernels.silu_mul_kernel()
    assert kernel is not None
    gate_up = (torch.randn(num_rows, 2 * 1536, generator=torch.Generator().manual_seed(num_rows)) * 4).to(
        dtype
    )
    gate, up = gate_up.split(1536, dim=-1)
    assert same_bits(kernel(gate_up, 1536), torch.nn.functional.silu(gate) * up)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        kernel(gate_up, 1000)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_adds_and_activation_give_the_unfused_models_bits(tmp_path: Path, dtype: str) -> None:
    """A model whose layers pass (residual, delta) pairs, each add taken with its norm, and whose
    MLPs run silu_mul, decodes the same beams, scores and log-probs bit for bit as the same model
    with every add, norm and activation apart; and the fused calls are the ones it makes."""
    from engine.config import CacheConfig, EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.models.decoder import MLP
    from tests.helpers.checkpoints import write_random_llama_checkpoint

    model_dir = write_random_llama_checkpoint(
        tmp_path,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
    )
    config = EngineConfig(
        model=str(model_dir), dtype=dtype, cache=CacheConfig(tokens_per_block=32, num_blocks=256)
    )
    engines = [LLMEngine(config), LLMEngine(config)]
    fused_model, apart_model = (engine.runner.model for engine in engines)
    calls: list[str] = []
    for module in fused_model.modules():
        if isinstance(module, RMSNorm) and module.native_add is not None:
            add = module.native_add
            module.native_add = lambda *args, add=add: calls.append("add_rms_norm") or add(*args)
        if isinstance(module, MLP) and module.native_silu_mul is not None:
            silu_mul = module.native_silu_mul
            module.native_silu_mul = lambda *args, f=silu_mul: calls.append("silu_mul") or f(*args)
    apart_model.pairs_residuals = False
    for module in apart_model.modules():
        if isinstance(module, RMSNorm):
            module.native_add = None
        if isinstance(module, MLP):
            module.native_silu_mul = None
    params = SamplingParams(beam_width=4, max_new_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(length)] for i, length in enumerate((5, 40, 90))]
    results = []
    for engine in engines:
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, params)
        finished = {}
        while engine.has_unfinished():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = [
                        (beam.token_ids, beam.score, beam.cumulative_logprob, beam.logprobs)
                        for beam in output.beams
                    ]
        results.append(finished)
    assert results[0] == results[1] and len(results[0]) == 3
    # 3 layers: the second norm of every layer and the first of layers 2 and 3, every step; and one
    # silu_mul per MLP whose gate and up the warm-up fused (all 3 where this host's fusion check
    # holds at this shape: not for bfloat16 on an AVX2-only host, whose MLPs keep them apart)
    fused_mlps = sum(
        isinstance(module, MLP) and "gate_up_proj" in module._modules for module in fused_model.modules()
    )
    assert (
        calls.count("add_rms_norm") > 0
        and calls.count("silu_mul") * 5 == calls.count("add_rms_norm") * fused_mlps
    )
