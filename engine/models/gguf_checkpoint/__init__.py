"""GGUF checkpoints: llama, qwen2, qwen3, qwen3moe, gemma3 and phi3 files read back into the Hugging
Face config dict and tensor names of their family (checkpoint.py; per-architecture tables in
architectures.py, tensor conversions in tensors.py, tokenizers in bpe_tokenizer.py and
spm_tokenizer.py)."""

from engine.models.gguf_checkpoint.checkpoint import GGUFCheckpoint
from engine.models.gguf_checkpoint.metadata import GGUFError

__all__ = ["GGUFCheckpoint", "GGUFError"]
