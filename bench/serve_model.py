"""The serving benchmark's model: a random Llama written once as a Hugging Face directory.

Both our servers (`--model DIR`) and transformers' `LlamaForCausalLM.from_pretrained(DIR)` load
the very same file, so the three systems run the same weights in the same dtype. The directory
holds `config.json`, `generation_config.json` and `model.safetensors`, and no `tokenizer.json`:
the benchmark sends token ids, and our servers fall back to the byte tokenizer for the (unused)
text, while validating ids against the model's 32000-entry vocabulary.

Weights are drawn from one seeded CPU generator in parameter-name order (norm weights around 1,
linear weights with std 1/sqrt(fan_in), embeddings std 1, as the tests' random checkpoints), so
logits are far from uniform and beam search has clear winners. A `bench_model.json` next to the
weights records the preset; a directory whose record differs is rewritten, never reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_CACHE_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "beamsplit" / "bench-models"
)
RECORD_FILE = "bench_model.json"


@dataclass(frozen=True)
class ModelPreset:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_parameters(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size  # two RMSNorm weights
        embeddings = 2 * self.vocab_size * self.hidden_size  # untied: embed_tokens and lm_head
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def describe(self) -> dict[str, object]:
        return {
            **asdict(self),
            "head_dim": self.head_dim,
            "num_parameters": self.num_parameters,
            "architecture": "LlamaForCausalLM, random weights, untied embeddings, no tokenizer (token ids)",
        }


PRESETS = {
    # The benchmark model: compute, not Python overhead, dominates a forward pass.
    "llama-156m": ModelPreset("llama-156m", 8, 1024, 16, 4, 2816, 32000, 8192),
    # For --quick checks and the test: same code path, seconds instead of minutes.
    "llama-small": ModelPreset("llama-small", 2, 64, 4, 2, 128, 512, 4096),
}


def ensure_checkpoint(preset: ModelPreset, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The preset's directory under `cache_dir`, written (atomically, by rename) if missing."""
    directory = cache_dir / preset.name
    if _is_current(directory, preset):
        return directory
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{preset.name}-", dir=cache_dir))
    try:
        _write_checkpoint(preset, staging)
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _is_current(directory: Path, preset: ModelPreset) -> bool:
    record = directory / RECORD_FILE
    if not record.is_file() or not (directory / "model.safetensors").is_file():
        return False
    try:
        return bool(json.loads(record.read_text()) == asdict(preset))
    except (OSError, ValueError):
        return False


def _write_checkpoint(preset: ModelPreset, directory: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(preset.seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif "embed_tokens" in name:
                values = torch.randn(parameter.shape, generator=generator)
            else:
                values = torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5
            parameter.copy_(values)
    model.save_pretrained(directory)
    (directory / RECORD_FILE).write_text(json.dumps(asdict(preset), indent=1))
