"""Builds a LlamaModel or an Lfm2Model from what `--model` names (engine/models/source.py).

A Hugging Face directory holds `config.json`, one or more `*.safetensors` (sharded through
`model.safetensors.index.json` or not) and optionally `tokenizer.json`. A GGUF file carries config,
weights, tokenizer and chat template in one (engine/models/gguf_checkpoint/). `tiny` (Llama) and
`tiny-hybrid` (LFM2) need no files: their weights come from a fixed seed on the CPU generator, so
every process builds the same bits.
Loading logs its progress, its time and the process's resident memory through `logging`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.models.config import ATTENTION_LAYER, CONV_LAYER, ModelConfig
from engine.models.decoder import LlamaModel
from engine.models.gguf_checkpoint import GGUFCheckpoint
from engine.models.lfm2 import Lfm2Model
from engine.models.q8_embedding import Q8Rows, untie_as_q8
from engine.models.source import ModelFormat, resolve_model_source
from engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)
TINY_SEED = 1234
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
Model = LlamaModel | Lfm2Model
EMBEDDING = "embed_tokens.weight"  # the state-dict name of every family's token embedding


def make_model(config: ModelConfig) -> Model:
    return Lfm2Model(config) if config.model_type == "lfm2" else LlamaModel(config)


def tiny_model_config() -> ModelConfig:
    tokenizer = ByteTokenizer()
    return ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tiny_hybrid_model_config() -> ModelConfig:
    """LFM2's layer pattern in small: convolution layers around two attention layers."""
    conv, attention = CONV_LAYER, ATTENTION_LAYER
    return replace(
        tiny_model_config(),
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        model_type="lfm2",
        layer_types=(conv, attention, conv, attention),
        conv_kernel_size=3,
    )


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(
    name_or_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    compact_tied_embedding: bool = False,
    on_config: Callable[[ModelConfig], None] | None = None,
) -> tuple[Model, ModelConfig, Tokenizer]:
    """compact_tied_embedding: a model whose head is tied to its embedding keeps the embedding in
    Q8_0 form where that gives the same bits (engine/models/q8_embedding.py: a GGUF file's Q8_0
    blocks, or a float32 checkpoint's values that are exactly such blocks), for a caller that packs
    the head (its dense copy is then the head's alone, and dropped). on_config: called with the
    model's config as soon as it is read, before any weight is."""
    torch_dtype = resolve_dtype(dtype)
    source = resolve_model_source(name_or_dir)
    q8_rows: dict[str, Q8Rows | None] = {}  # the embedding's Q8_0 rows, where a checkpoint holds them
    started = time.monotonic()
    if source.is_tiny:
        config = tiny_model_config() if source.format is ModelFormat.TINY else tiny_hybrid_model_config()
        if on_config is not None:
            on_config(config)
        model = build_tiny_model(config)
        tokenizer: Tokenizer = ByteTokenizer()
    elif source.format is ModelFormat.GGUF:
        assert source.path is not None
        logger.info("loading %s (GGUF) as %s", source.path, torch_dtype)
        checkpoint = GGUFCheckpoint.open(source.path)
        config, tokenizer = checkpoint.config, checkpoint.tokenizer()
        if on_config is not None:
            on_config(config)
        state = checkpoint.state_dict(torch_dtype, lambda message: logger.info("%s", message))
        model = _build_model(config, state, str(source.path))
        if compact_tied_embedding and config.tie_word_embeddings:
            q8_rows[EMBEDDING] = checkpoint.embedding_q8_rows()
    else:
        assert source.path is not None
        config = ModelConfig.from_file(source.path / "config.json")
        if on_config is not None:
            on_config(config)
        compact = compact_tied_embedding and config.tie_word_embeddings
        model = build_model_from_checkpoint(config, source.path, torch_dtype, q8_rows if compact else None)
        tokenizer = load_tokenizer(source.path, config.bos_token_id, config.eos_token_id)
    model = model.to(dtype=torch_dtype, device=device).eval()
    if compact_tied_embedding and config.tie_word_embeddings:
        untie_as_q8(model, q8_rows.get(EMBEDDING))
    if not source.is_tiny:
        num_parameters = sum(parameter.numel() for parameter in model.parameters())
        logger.info(
            "model loaded: %.1fM parameters, %s, in %.1f s; resident memory %.0f MiB",
            num_parameters / 1e6, torch_dtype, time.monotonic() - started, resident_memory_mib(),
        )  # fmt: skip
    return model, config, tokenizer


def load_model_tokenizer(name_or_dir: str | Path) -> Tokenizer:
    """The tokenizer alone (the coordinator's need): no weights are read or de-quantized."""
    source = resolve_model_source(name_or_dir)
    if source.is_tiny:
        return ByteTokenizer()
    assert source.path is not None
    if source.format is ModelFormat.GGUF:
        return GGUFCheckpoint.open(source.path).tokenizer()
    config = ModelConfig.from_file(source.path / "config.json")
    return load_tokenizer(source.path, config.bos_token_id, config.eos_token_id)


def resident_memory_mib() -> float:
    """This process's resident set now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_tiny_model(config: ModelConfig) -> Model:
    """Weights from one seeded CPU generator, drawn in parameter-name order, in float32.

    Linear weights have std 1/sqrt(fan_in) and embeddings std 1, so the logits are far from
    uniform and greedy and beam search have clear winners rather than near-ties.
    """
    model = make_model(config)
    generator = torch.Generator(device="cpu").manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif name == "embed_tokens.weight":
                values = torch.randn(parameter.shape, generator=generator)
            else:
                fan_in = parameter.shape[-1]
                values = torch.randn(parameter.shape, generator=generator) / fan_in**0.5
            parameter.copy_(values)
    return model


def build_model_from_checkpoint(
    config: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype | None = None,
    q8_rows: dict[str, Q8Rows | None] | None = None,
) -> Model:
    """dtype: the floating tensors' dtype once read (None: the checkpoint's own); q8_rows: see
    _read_checkpoint."""
    origins: dict[str, str] = {}
    state = _read_checkpoint(model_dir, origins, dtype, q8_rows)
    return _build_model(config, state, f"checkpoint in {model_dir}", origins)


def _build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], where: str, origins: dict[str, str] | None = None
) -> Model:
    """`origins`: the file each tensor came from, so a shape error names the file."""
    with torch.device("meta"):
        model = make_model(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        # Tied checkpoints usually omit lm_head; the embedding is the head either way.
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{where} does not match the config: missing {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        expected_shape = tuple(model.get_parameter(name).shape)
        if tuple(tensor.shape) != expected_shape:
            raise ValueError(
                f"{(origins or {}).get(name, where)}: tensor {name} has shape {tuple(tensor.shape)}, config says {expected_shape}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _read_checkpoint(
    model_dir: Path,
    origins: dict[str, str],
    dtype: torch.dtype | None = None,
    q8_rows: dict[str, Q8Rows | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's files, each a copy this process owns (in `dtype` where
    given and floating): safetensors maps the file, and a tensor left on the mapping keeps the
    whole file resident beside the packed weights that replace it (measured: SmolLM2-135M in
    float32 held its 513 MiB file next to 550 MiB of packed weights). q8_rows: where given, gets
    the embedding's Q8_0 rows found in its stored values, before any cast (Q8Rows.from_dense)."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        with open(index_file, encoding="utf-8") as file:
            weight_map: dict[str, str] = json.load(file)["weight_map"]
        files = sorted({model_dir / shard for shard in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file_path in files:
        try:
            tensors = load_file(str(file_path), device="cpu")
        except OSError:
            raise
        except Exception as error:  # safetensors' own error type: truncated or not safetensors at all
            raise ValueError(f"{file_path}: not a readable safetensors file ({error})") from None
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # older exports saved the rotary table; it is rebuilt from the config
            if q8_rows is not None and name.removeprefix("model.") == EMBEDDING:
                q8_rows[EMBEDDING] = Q8Rows.from_dense(tensor)
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            else:
                tensor = tensor.clone()
            state[name.removeprefix("model.")] = tensor
            origins[name.removeprefix("model.")] = str(file_path)
    return state
