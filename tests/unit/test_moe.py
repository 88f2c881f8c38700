"""The Qwen3-MoE feed-forward (engine/models/moe.py) against transformers' Qwen3MoeSparseMoeBlock.

float64: equal to 1e-9 on random weights loaded from one state dict, norm_topk_prob on and off,
batches where tokens share experts and experts go unpicked. Names: the `mlp.` slice of a tiny
Qwen3-MoE checkpoint written by transformers' save_pretrained loads by name (strict) and computes
what the saved model's layer computes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.moe import SparseMoeBlock

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 32, 24, 8, 3


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
    block = make_block(norm_topk_prob, seed=0)
    reference = transformers_block(block)
    saw_unpicked_expert = saw_every_expert = saw_shared_expert = False
    with torch.no_grad():
        for hidden in batches(seed=1):
            expected = reference(hidden[None]).squeeze(0)
            actual = block(hidden)
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
