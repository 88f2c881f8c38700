"""GGUF files of qwen2, qwen3, qwen3moe, gemma3 and phi3 read back into the Hugging Face checkpoint.

Each test saves a tiny random transformers checkpoint, converts it the way llama.cpp's
convert_hf_to_gguf does (names from `gguf`'s own tensor map, the metadata its `set_gguf_parameters`
writes, Gemma's norms stored as 1 + w, Qwen3-MoE's experts stacked into 3-D tensors), and checks
that the engine's reading gives back the same config (through the family's transformers config
class: every field equal but bookkeeping ones) and bit-identical tensors under HF names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from safetensors.torch import load_file

from engine.attention import prepare_attention
from engine.config import CacheConfig
from engine.kv_pool import KVPool
from engine.models.gguf_checkpoint import GGUFCheckpoint, GGUFError
from engine.models.loader import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 64
TOKENS = [chr(ord("!") + index) for index in range(VOCAB - 1)] + ['!"']  # byte-level, one merge
# Fields of transformers' config that a GGUF file does not carry and the engine does not read.
BOOKKEEPING = {
    "transformers_version", "architectures", "_name_or_path", "dtype", "pad_token_id", "initializer_range",
    "use_cache", "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "attention_dropout", "resid_pdrop",
    "embd_pdrop", "max_window_layers", "router_aux_loss_coef", "output_router_logits", "use_bidirectional_attention",
}  # fmt: skip
SIZES = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    "rms_norm_eps": 1e-6,
}  # fmt: skip
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {**SIZES, "num_hidden_layers": 2, "tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": ("Qwen3Config", {**SIZES, "num_hidden_layers": 2, "head_dim": 16, "tie_word_embeddings": False}),
    "qwen3moe": (
        "Qwen3MoeConfig",
        {
            **SIZES, "num_hidden_layers": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "norm_topk_prob": True,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            **SIZES, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
            "rope_theta": 1e6,
        },
    ),
    "phi3": (
        "Phi3Config",
        {**SIZES, "num_hidden_layers": 2, "num_key_value_heads": 4, "sliding_window": 32, "pad_token_id": 0},
    ),
}  # fmt: skip


def save_random_checkpoint(architecture: str, directory: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers config, the tensors save_pretrained wrote, names without `model.`)."""
    class_name, fields = CONFIGS[architecture]
    config = getattr(transformers, class_name)(**fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                # multiples of 1/64 below 1: w + 1 - 1 is exact in float32, so Gemma's shift round-trips
                parameter.copy_(torch.randint(-32, 32, parameter.shape) / 64)
            else:
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    model.save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    return config, {name.removeprefix("model."): tensor for name, tensor in tensors.items()}


def write_like_llama_cpp(
    architecture: str,
    config: Any,
    state: dict[str, torch.Tensor],
    path: Path,
    extra: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    arch = next(key for key, name in MODEL_ARCH_NAMES.items() if name == architecture)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(
        config.rope_parameters.get("rope_theta", 1e6) if architecture != "gemma3" else 1e6
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None and architecture != "phi3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if architecture == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if architecture == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if architecture == "phi3":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_rope_scaling_attn_factors(1.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if extra is not None:
        extra(writer)
    experts: dict[str, list[torch.Tensor]] = {}
    for name, tensor in state.items():
        if ".experts." in name:  # layers.{i}.mlp.experts.{e}.{proj}.weight -> stacked per projection
            layer, expert_name = name.split(".mlp.experts.")
            stacked = f"model.{layer}.mlp.experts.{expert_name.split('.', 1)[1].removesuffix('.weight')}"
            experts.setdefault(stacked, []).append(tensor)
            continue
        values = tensor.to(torch.float32)
        if architecture == "gemma3" and name.endswith("norm.weight"):
            values = values + 1  # llama.cpp's Gemma converter: its norm multiplies by the weight
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, np.ascontiguousarray(values.numpy()))
    for name, tensors in experts.items():
        gguf_name = names.get_name(name)
        assert gguf_name is not None, name
        writer.add_tensor(f"{gguf_name}.weight", torch.stack(tensors).numpy())  # [experts, out, in]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def comparable(config: Any) -> dict[str, Any]:
    return {key: value for key, value in config.to_dict().items() if key not in BOOKKEEPING}


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_gguf_reads_back_the_checkpoint(architecture: str, tmp_path: Path) -> None:
    config, state = save_random_checkpoint(architecture, tmp_path)
    checkpoint = GGUFCheckpoint.open(write_like_llama_cpp(architecture, config, state, tmp_path / "x.gguf"))
    reread = type(config)(**checkpoint.hf_config)
    assert comparable(reread) == comparable(config)
    tensors = checkpoint.state_dict(torch.float32)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert sorted(tensors) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor.to(torch.float32)), name
    # Through the family layer: the GGUF file computes the directory's logits to the last bit.
    token_ids = [5, 17, 3, 60, 41, 2, 44, 8, 30, 12, 33, 1, 9, 50, 7, 22, 61, 19, 4]  # past window 8
    assert torch.equal(last_logits(tmp_path / "x.gguf", token_ids), last_logits(tmp_path, token_ids))


def last_logits(model_name: Path, token_ids: list[int]) -> torch.Tensor:
    model, config, _ = load_model(model_name, "float64", "cpu")
    pool = KVPool(config, CacheConfig(tokens_per_block=16, num_blocks=4), torch.float64, "cpu")
    metadata = prepare_attention(
        [([0, 1], 0, len(token_ids))], 16, torch.device("cpu"), sliding_windows=config.sliding_windows
    )
    return model(torch.tensor(token_ids), metadata.positions, pool, metadata)


def test_unread_metadata_is_named(tmp_path: Path) -> None:
    config, state = save_random_checkpoint("gemma3", tmp_path)
    # one key no table reads: a soft-cap the engine would otherwise silently ignore
    path = write_like_llama_cpp(
        "gemma3", config, state, tmp_path / "x.gguf", lambda writer: writer.add_router_logit_softcapping(30.0)
    )
    with pytest.raises(
        GGUFError, match=r"metadata \['gemma3.router_logit_softcapping'\] is not supported"
    ) as error:
        GGUFCheckpoint.open(path)
    assert "\n" not in str(error.value)


def test_unknown_architecture_and_tensor_are_named(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=r"architecture 'falcon' is not supported \(supported: \('llama', 'qwen2'"
    ):
        GGUFCheckpoint.open(tmp_path / "falcon.gguf")
    config, state = save_random_checkpoint("phi3", tmp_path)
    state["layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 32)  # Phi-3 keeps q, k, v fused
    checkpoint = GGUFCheckpoint.open(write_like_llama_cpp("phi3", config, state, tmp_path / "x.gguf"))
    with pytest.raises(GGUFError, match="tensor 'blk.0.attn_q.weight' is not part of a phi3 model"):
        checkpoint.state_dict(torch.float32)
