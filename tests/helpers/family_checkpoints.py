"""Random tiny checkpoints of every family the engine loads, written by transformers itself.

`write_family_checkpoint(dir, family)` builds the family's *ForCausalLM from a small config with a
tiny sliding window (SLIDING_WINDOW) where the family has one, redraws the weights from a seeded
generator (linear weights std 1/sqrt(fan_in), norms near their identity, biases small), and saves
it with save_pretrained. `reference_class(family)` is the transformers class to load it with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SLIDING_WINDOW = 8
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "phi3")
_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    # No eos in the checkpoint: transformers' generate falls back to the checkpoint's eos when a
    # test asks for none, so the tests name the eos they want per request.
    "eos_token_id": None,
    "pad_token_id": 0,
}


def family_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny `family` checkpoint."""
    import transformers

    window = SLIDING_WINDOW
    settings: dict[str, Any]
    if family == "llama":
        return transformers.LlamaConfig(**{**_COMMON, **overrides})
    if family == "qwen2":
        # Layer 0 full, layer 1 sliding: max_window_layers decides, as in Qwen2.5 configs.
        settings = {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1}
        return transformers.Qwen2Config(**{**_COMMON, **settings, **overrides})
    if family == "qwen3":
        # head_dim apart from hidden / heads (32 / 4 = 8); tied, as the small Qwen3 are.
        settings = {"head_dim": 16, "tie_word_embeddings": True, "attention_bias": False}
        return transformers.Qwen3Config(**{**_COMMON, **settings, **overrides})
    if family == "qwen3_moe":
        settings = {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        }
        return transformers.Qwen3MoeConfig(**{**_COMMON, **settings, **overrides})
    if family == "mistral":
        settings = {"sliding_window": window, "head_dim": 8}
        return transformers.MistralConfig(**{**_COMMON, **settings, **overrides})
    if family == "gemma3":
        settings = {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": window,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 15.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
        }
        return transformers.Gemma3TextConfig(**{**_COMMON, **settings, **overrides})
    if family == "phi3":
        settings = {"sliding_window": window, "tie_word_embeddings": False}
        return transformers.Phi3Config(**{**_COMMON, **settings, **overrides})
    raise ValueError(f"unknown family {family!r}")


def reference_class(family: str) -> Any:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
    }[family]


def load_reference(family: str, directory: str | Path, dtype: Any) -> Any:
    """The checkpoint loaded by transformers in `dtype`, eval mode. Qwen3-MoE's experts run eagerly:
    the default grouped_mm kernel has no float64."""
    options = {"experts_implementation": "eager"} if family == "qwen3_moe" else {}
    return reference_class(family).from_pretrained(directory, dtype=dtype, **options).eval()


def write_family_checkpoint(directory: str | Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    import torch

    directory = Path(directory)
    config = family_config(family, **overrides)
    model = reference_class(family)(config)
    offset_norms = family == "gemma3"  # Gemma scales by (1 + weight): weights near 0 are near identity
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                values = 0.1 * noise + (0.0 if offset_norms else 1.0)
            elif "embed_tokens" in name:
                values = noise
            elif parameter.dim() == 1:  # biases
                values = 0.2 * noise
            else:  # linear weights, the router, the experts' stacked weights: by fan-in
                values = noise / parameter.shape[-1] ** 0.5
            parameter.copy_(values.to(parameter.dtype))
    model.save_pretrained(directory)
    return directory
