"""Tokenizers (byte fallback, tokenizer.json) and the embedded tiny model's determinism."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.decoder import LlamaModel
from engine.models.loader import load_model
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY_DIGEST_SCRIPT = """
import hashlib, torch
from engine.models.loader import load_model
model, _, _ = load_model("tiny", "float32", "cpu")
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode()); digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


def weights_digest(model: LlamaModel) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_byte_tokenizer_round_trips_and_skips_specials() -> None:
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    text = "héllo, wörld ✓ 🚀"
    token_ids = tokenizer.encode(text)
    assert all(0 <= token_id < 256 for token_id in token_ids)
    assert tokenizer.decode(token_ids) == text
    assert tokenizer.decode([tokenizer.BOS_TOKEN_ID, *token_ids, tokenizer.EOS_TOKEN_ID]) == text
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (260, 256, 257)
    # A beam cut inside a multi-byte character still decodes.
    assert tokenizer.decode(token_ids[:2]) == "h\ufffd"


def test_tokenizer_json_is_used_when_present(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": {"content": "</s>"}}')

    tokenizer = load_tokenizer(tmp_path, bos_token_id=None, eos_token_id=None)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("hello world") == [3, 4]
    assert tokenizer.decode([0, 3, 4, 1]) == "hello world"
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id) == (5, 0, 1)
    # The model config's ids win over tokenizer_config.json.
    assert load_tokenizer(tmp_path, bos_token_id=3, eos_token_id=4).eos_token_id == 4


def test_directory_without_tokenizer_json_falls_back_to_bytes(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(tmp_path, None, None), ByteTokenizer)


def test_tiny_is_bit_identical_across_processes() -> None:
    torch.set_num_threads(1)
    model, config, tokenizer = load_model("tiny", "float32", "cpu")
    assert config.vocab_size == tokenizer.vocab_size == 260
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert weights_digest(model) == weights_digest(load_model("tiny", "float32", "cpu")[0])
    other_process = subprocess.run(
        [sys.executable, "-c", TINY_DIGEST_SCRIPT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert other_process.stdout.strip() == weights_digest(model)


def test_tiny_casts_to_each_dtype() -> None:
    for dtype, torch_dtype in (("float64", torch.float64), ("bfloat16", torch.bfloat16)):
        model, _, _ = load_model("tiny", dtype, "cpu")
        assert model.dtype == torch_dtype
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", "float16", "cpu")


def test_missing_model_directory_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere", "float32", "cpu")
