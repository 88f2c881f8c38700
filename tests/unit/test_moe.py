"""The Qwen3-MoE feed-forward (engine/models/moe.py) against transformers' Qwen3MoeSparseMoeBlock.

float64: equal to 1e-9 on random weights loaded from one state dict, norm_topk_prob on and off,
batches where tokens share experts and experts go unpicked. Names: the `mlp.` slice of a tiny
Qwen3-MoE checkpoint written by transformers' save_pretrained loads by name (strict) and computes
what the saved model's layer computes. Batch invariance (float32 and float64, on each of
invariant_linear's paths): with make_batch_invariant, a token's output row is bitwise the same
alone and among other tokens (some routed to its experts), with and without the pass's RowLayout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import batch_invariant, onednn_calls
from engine.models.moe import SparseMoeBlock, invariant_silu

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 32, 24, 8, 3
LINEAR_PATHS = ["onednn", "columns", "one-matmul", "grouped"]


@pytest.fixture(params=LINEAR_PATHS)
def linear_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """invariant_linear's four ways of keeping rows apart (as in test_batch_invariance.py): the
    later ones are forced by reporting the earlier kernels' checks as failed."""
    if request.param != "onednn":
        monkeypatch.setattr(onednn_calls, "onednn_rows_are_independent", lambda *args: False)
    if request.param not in ("onednn", "columns"):
        monkeypatch.setattr(batch_invariant, "columns_are_independent", lambda *args: False)
    if request.param == "grouped":
        monkeypatch.setattr(batch_invariant, "rows_are_independent", lambda *args: False)
    return str(request.param)


def make_block(norm_topk_prob: bool, seed: int, dtype: torch.dtype = torch.float64) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
    )
    return block.to(dtype)


def transformers_block(block: SparseMoeBlock) -> torch.nn.Module:
    """transformers' block of the same shape, loaded from `block`'s state dict (its experts fused:
    gate_up_proj [X, 2I, E] is each expert's gate rows then its up rows, as its chunk(2) splits)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=block.norm_topk_prob,
    )
    reference = Qwen3MoeSparseMoeBlock(config).to(torch.float64)
    state = block.state_dict()
    experts = range(NUM_EXPERTS)
    reference.load_state_dict(
        {
            "gate.weight": state["gate.weight"],
            "experts.gate_up_proj": torch.stack(
                [
                    torch.cat((state[f"experts.{j}.gate_proj.weight"], state[f"experts.{j}.up_proj.weight"]))
                    for j in experts
                ]
            ),
            "experts.down_proj": torch.stack([state[f"experts.{j}.down_proj.weight"] for j in experts]),
        }
    )
    return reference.eval()


def batches(seed: int) -> list[torch.Tensor]:
    """[N, E] batches: one token, a few, many, and ones whose tokens repeat (same experts)."""
    generator = torch.Generator().manual_seed(seed)
    token = torch.randn(1, HIDDEN, generator=generator, dtype=torch.float64)
    return [
        token,
        torch.randn(2, HIDDEN, generator=generator, dtype=torch.float64),
        torch.randn(5, HIDDEN, generator=generator, dtype=torch.float64),
        torch.cat((token, token, token)),
        torch.cat((torch.randn(6, HIDDEN, generator=generator, dtype=torch.float64), token, token)),
        torch.randn(64, HIDDEN, generator=generator, dtype=torch.float64),
    ]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_float64_equals_transformers(norm_topk_prob: bool) -> None:
    """The plain block and its batch-invariant twin (same weights) both."""
    block = make_block(norm_topk_prob, seed=0)
    reference = transformers_block(block)
    invariant = batch_invariant.make_batch_invariant(make_block(norm_topk_prob, seed=0))
    saw_unpicked_expert = saw_every_expert = saw_shared_expert = False
    with torch.no_grad():
        for hidden in batches(seed=1):
            expected = reference(hidden[None]).squeeze(0)
            for actual in (block(hidden), invariant(hidden)):
                assert actual.dtype == torch.float64 and actual.shape == hidden.shape
                torch.testing.assert_close(actual, expected, rtol=0, atol=1e-9)
            _, expert_ids = block.route(hidden)
            counts = torch.bincount(expert_ids.reshape(-1), minlength=NUM_EXPERTS)
            saw_unpicked_expert |= bool((counts == 0).any())
            saw_every_expert |= bool((counts > 0).all())
            saw_shared_expert |= bool((counts > 1).any())
    assert saw_unpicked_expert and saw_every_expert and saw_shared_expert


def test_routing_weights_equal_transformers_router() -> None:
    """The router's weights are transformers' bit for bit (float32 softmax, then cast), and the
    renormalised ones sum to 1 per token."""
    for norm_topk_prob in (True, False):
        block = make_block(norm_topk_prob, seed=2)
        reference = transformers_block(block)
        hidden = batches(seed=3)[-1]
        with torch.no_grad():
            _, expected_weights, expected_ids = reference.gate(hidden)
            weights, expert_ids = block.route(hidden)
        assert torch.equal(expert_ids, expected_ids)
        assert torch.equal(weights, expected_weights)
        if norm_topk_prob:
            torch.testing.assert_close(weights.sum(-1), torch.ones(hidden.shape[0], dtype=torch.float64))
        else:
            assert bool((weights.sum(-1) < 1).all())


def test_bad_arguments_are_refused_by_name() -> None:
    arguments = dict(
        hidden_size=8, moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    )
    for field, value in (("num_experts", 0), ("hidden_size", 8.0), ("num_experts_per_tok", 5)):
        with pytest.raises(ValueError, match=field):
            SparseMoeBlock(**{**arguments, field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_topk_prob"):
        SparseMoeBlock(**{**arguments, "norm_topk_prob": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[tokens, 8\]"):
        SparseMoeBlock(**arguments)(torch.zeros(3, 7))  # type: ignore[arg-type]


def test_a_saved_qwen3_moe_layer_loads_by_name(tmp_path: Path) -> None:
    """transformers' save_pretrained of a tiny Qwen3-MoE: each sparse layer's `mlp.` slice of the
    file loads here strictly (same names, same shapes) and computes what that layer computes."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(4)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=40,
        moe_intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        experts_implementation="eager",  # the default, grouped_mm, has no float64 kernel
    )
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    hidden = batches(seed=5)[-1]
    for layer_index in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_index}.mlp."
        layer_state = {
            name[len(prefix) :]: tensor for name, tensor in tensors.items() if name.startswith(prefix)
        }
        assert "experts.0.gate_proj.weight" in layer_state
        block = make_block(norm_topk_prob=True, seed=6, dtype=torch.float32)
        block.load_state_dict(layer_state, strict=True)
        reference = model.model.layers[layer_index].mlp.to(torch.float64)
        with torch.no_grad():
            expected = reference(hidden[None]).squeeze(0)
            actual = block.to(torch.float64)(hidden)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-9)


def invariant_block(dtype: torch.dtype) -> tuple[SparseMoeBlock, SparseMoeBlock]:
    """(plain block, the same weights made batch-invariant)."""
    plain = make_block(norm_topk_prob=True, seed=7, dtype=dtype)
    invariant = make_block(norm_topk_prob=True, seed=7, dtype=dtype)
    batch_invariant.make_batch_invariant(invariant)
    assert all(
        type(layer) is batch_invariant.RowChunkedLinear
        for layer in (invariant.gate, invariant.experts[0].up_proj)
    )
    return plain, invariant


def neighbours(row: torch.Tensor, num_rows: int, generator: torch.Generator) -> torch.Tensor:
    """[num_rows, E] random rows, every third one `row` scaled by 1.5 (its experts, other numbers)."""
    batch = torch.randn(num_rows, HIDDEN, generator=generator, dtype=row.dtype)
    batch[::3] = 1.5 * row
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tokens_row_does_not_depend_on_the_batch(dtype: torch.dtype, linear_path: str) -> None:
    generator = torch.Generator().manual_seed(8)
    plain, block = invariant_block(dtype)
    row = torch.randn(1, HIDDEN, generator=generator, dtype=dtype)
    with torch.no_grad():
        alone = block(row)[0]
        torch.testing.assert_close(alone, plain(row)[0])
        for num_rows in (2, 3, 5, 13, 37):
            for position in (0, num_rows // 2, num_rows - 1):
                batch = neighbours(row[0], num_rows, generator)
                batch[position] = row[0]
                assert torch.equal(block(batch)[position], alone), (num_rows, position)
        _, expert_ids = block.route(batch)
        assert bool((torch.bincount(expert_ids.reshape(-1), minlength=NUM_EXPERTS) > 1).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_do_not_depend_on_the_batch_under_the_passs_row_layout(
    dtype: torch.dtype, linear_path: str
) -> None:
    """As ModelRunner runs it: the pass's RowLayout set (the router's rows are the pass's tokens;
    an expert's are not). A decode row of a width-W request and a prompt's last row give the same
    bits alone and among other requests' prompt, beam and single rows."""
    generator = torch.Generator().manual_seed(9)
    _, block = invariant_block(dtype)
    row = torch.randn(HIDDEN, generator=generator, dtype=dtype)
    # (rows per sequence, group sizes) of the other sequences, before and after this request's
    others = (
        (([1], [1]), ([], [])),
        (([1, 1, 1, 1], [4, 4, 4, 4]), ([1], [1])),
        (([37], [0]), ([1, 1], [2, 2])),
        (([5, 1, 1, 1], [0, 3, 3, 3]), ([20, 1], [0, 1])),
    )
    with torch.no_grad():
        for own_rows, own_groups in (([1], [1]), ([1, 1], [2, 2]), ([1] * 4, [4] * 4), ([6], [0])):
            own = neighbours(row, sum(own_rows), generator)
            own[-1] = row
            with batch_invariant.row_layout(batch_invariant.make_row_layout(own_rows, own_groups, "cpu")):
                alone = block(own)[-1]
            for before, after in others:
                num_new_tokens = [*before[0], *own_rows, *after[0]]
                batch = neighbours(row, sum(num_new_tokens), generator)
                first = sum(before[0])
                batch[first : first + len(own)] = own
                layout = batch_invariant.make_row_layout(
                    num_new_tokens, [*before[1], *own_groups, *after[1]], "cpu"
                )
                with batch_invariant.row_layout(layout):
                    assert torch.equal(block(batch)[first + len(own) - 1], alone), (own_groups, before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_invariant_silu_rows_do_not_depend_on_the_call(dtype: torch.dtype) -> None:
    """A row's silu bits alone equal its bits inside calls of other sizes, at widths that leave a
    vector tail (24, 100), that need none (768), and calls past the threads' grain (700 rows)."""
    generator = torch.Generator().manual_seed(10)
    for width in (24, 100, 768):
        row = torch.randn(1, width, generator=generator).to(dtype)
        alone = invariant_silu(row)[0]
        torch.testing.assert_close(alone, torch.nn.functional.silu(row)[0])
        for num_rows in (2, 3, 7, 700):
            batch = torch.randn(num_rows, width, generator=generator).to(dtype)
            for position in (0, num_rows - 1):
                batch[position] = row[0]
                assert torch.equal(invariant_silu(batch)[position], alone), (width, num_rows, position)
