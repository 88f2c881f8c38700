"""`beamsplit model export`: a served model as a Hugging Face directory, for client-side tools.

Tools that count tokens against a server (lm-eval, aiperf, guidellm) load a tokenizer with
transformers' `AutoTokenizer.from_pretrained(DIR)`. A packaged model ships as one GGUF file and
`tiny` has no files at all, so this writes what they look for, built from the very objects the
server tokenizes with, so that the tool counts exactly the server's tokens:

    tokenizer.json           the `tokenizers` pipeline the server runs (GGUF: rebuilt from its
                             vocabulary and merges; tiny: byte-level, one token per UTF-8 byte)
    tokenizer_config.json    PreTrainedTokenizerFast, bos/eos, the chat template, model_max_length
    special_tokens_map.json  bos/eos (and tiny's pad/unk)
    config.json              the model's shape in transformers' own format (LlamaForCausalLM or
                             Lfm2ForCausalLM); `ModelConfig.from_dict` reads it back unchanged
    model.safetensors        only with `include_weights`: float32, transformers' tensor names
                             (a GGUF is de-quantized, about 4 bytes per parameter)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from engine.models.config import ModelConfig
from engine.models.gguf_checkpoint import GGUFCheckpoint
from engine.models.loader import (
    build_tiny_model,
    load_model_tokenizer,
    tiny_hybrid_model_config,
    tiny_model_config,
)
from engine.models.source import ModelFormat, resolve_model_source
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, byte_alphabet


def export_model(
    name_or_dir: str, out_dir: Path, include_weights: bool = False, progress: Callable[[str], None] = print
) -> list[Path]:
    """Writes the files above into `out_dir` (created; existing files of these names are replaced)
    and returns their paths."""
    source = resolve_model_source(name_or_dir)
    tokenizer: Tokenizer
    if source.format is ModelFormat.GGUF:  # opened once: its tokenizer is rebuilt from the metadata
        assert source.path is not None
        checkpoint = GGUFCheckpoint.open(source.path)
        config, tokenizer = checkpoint.config, checkpoint.tokenizer()
    else:
        config, tokenizer = model_config_of(name_or_dir), load_model_tokenizer(name_or_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        _write_text(out_dir / "tokenizer.json", tokenizer_json(tokenizer)),
        _write_json(out_dir / "tokenizer_config.json", tokenizer_config(tokenizer, config)),
        _write_json(out_dir / "special_tokens_map.json", _special_tokens(tokenizer)),
        _write_json(out_dir / "config.json", hf_config(config)),
    ]
    if include_weights:
        progress(f"writing the weights of {name_or_dir} (float32) ...")
        if source.format is ModelFormat.HF_DIRECTORY:
            assert source.path is not None
            for file_path in sorted(source.path.glob("*.safetensors*")):
                written.append(Path(shutil.copy2(file_path, out_dir / file_path.name)))
        else:
            path = out_dir / "model.safetensors"
            save_file(_hf_state_dict(name_or_dir, config), str(path), metadata={"format": "pt"})
            written.append(path)
    return written


def tokenizer_json(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, HFTokenizer):
        return str(tokenizer.raw.to_str(pretty=True))
    if isinstance(tokenizer, ByteTokenizer):
        return str(_byte_level_tokenizer().to_str(pretty=True))
    raise TypeError(f"cannot export a {type(tokenizer).__name__}")


def _byte_level_tokenizer() -> RawTokenizer:
    """ByteTokenizer as a `tokenizers` pipeline: byte b is token b, spelled in GPT-2's alphabet;
    no merges, so every byte stays its own token; the specials follow at 256.."""
    alphabet = byte_alphabet()
    vocab = {alphabet[byte]: byte for byte in range(ByteTokenizer.NUM_BYTES)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in ByteTokenizer.SPECIAL_TOKENS]
    )
    return raw


def tokenizer_config(tokenizer: Tokenizer, config: ModelConfig) -> dict[str, Any]:
    """No BOS or EOS is added beyond what tokenizer.json's post-processor adds, and decoding does
    not tidy spaces: the server does neither."""
    template = tokenizer.chat_template
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **_special_tokens(tokenizer),
        **({"chat_template": template.source} if template is not None else {}),
    }


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for name, token_id in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id)):
        if token_id is not None:
            tokens[name] = tokenizer.id_to_token(token_id)
    if isinstance(tokenizer, ByteTokenizer):
        tokens["pad_token"] = tokenizer.id_to_token(ByteTokenizer.PAD_TOKEN_ID)
        tokens["unk_token"] = tokenizer.id_to_token(ByteTokenizer.UNK_TOKEN_ID)
    return tokens


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """transformers' config.json for `config` (the inverse of `ModelConfig.from_dict`)."""
    common: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }
    if config.model_type == "lfm2":
        return {
            "architectures": ["Lfm2ForCausalLM"],
            "model_type": "lfm2",
            **common,
            "block_auto_adjust_ff_dim": False,  # intermediate_size is already the layers' width
            "norm_eps": config.rms_norm_eps,
            "layer_types": list(config.layer_types),
            "conv_L_cache": config.conv_kernel_size,
            "conv_bias": config.conv_bias,
        }
    scaling = config.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": config.model_type,
        **common,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    }


def model_config_of(name_or_dir: str) -> ModelConfig:
    """The config `--model name_or_dir` serves with (no weights read)."""
    source = resolve_model_source(name_or_dir)
    if source.format is ModelFormat.TINY:
        return tiny_model_config()
    if source.format is ModelFormat.TINY_HYBRID:
        return tiny_hybrid_model_config()
    assert source.path is not None
    if source.format is ModelFormat.GGUF:
        return GGUFCheckpoint.open(source.path).config
    return ModelConfig.from_file(source.path / "config.json")


def _hf_state_dict(name_or_dir: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' names: the engine's with `model.` in front, except the head."""
    source = resolve_model_source(name_or_dir)
    if source.is_tiny:
        state = {
            name: tensor.detach().clone() for name, tensor in build_tiny_model(config).state_dict().items()
        }
    else:
        assert source.path is not None
        state = GGUFCheckpoint.open(source.path).state_dict(torch.float32)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {
        name if name.startswith("lm_head.") else f"model.{name}": tensor.to(torch.float32).contiguous()
        for name, tensor in state.items()
    }


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _write_json(path: Path, value: dict[str, Any]) -> Path:
    return _write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")
