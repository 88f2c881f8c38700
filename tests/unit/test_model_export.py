"""`beamsplit model export`: the exported directory, loaded with transformers' AutoTokenizer,
encodes and decodes exactly as the server's tokenizer does; config.json reads back unchanged;
the optional weights load into the engine as the same tensors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.export import export_model, model_config_of
from engine.models.gguf_checkpoint import GGUFCheckpoint
from engine.models.loader import build_tiny_model, load_model, load_model_tokenizer
from engine.models.source import resolve_model_source
from engine.tokenizer import ByteTokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = (
    "hello world",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "digits 1234567890 and 3.14159",
    "unicode: héllo wörld — ünïcödé, 日本語, emoji 🙂👍🏽",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
)


def _export(model: str, out_dir: Path) -> Path:
    export_model(model, out_dir, progress=lambda message: None)
    return out_dir


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    """Exported once: rebuilding SmolLM2's tokenizer from the GGUF takes seconds."""
    try:
        ours = load_model_tokenizer("smollm2-135m")
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return _export("smollm2-135m", tmp_path_factory.mktemp("smollm2")), ours


def _check_tokenizer_matches(ours: Tokenizer, out_dir: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    for text in TEXTS:
        token_ids = ours.encode(text)
        assert theirs.encode(text) == token_ids, text
        assert theirs(text)["input_ids"] == token_ids, text
        assert theirs.decode(token_ids, skip_special_tokens=True) == ours.decode(token_ids), text
        assert theirs.convert_ids_to_tokens(token_ids) == [
            ours.id_to_token(token_id) for token_id in token_ids
        ]
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)


def test_tiny_export_counts_the_servers_tokens(tmp_path: Path) -> None:
    out_dir = _export("tiny", tmp_path / "tiny")
    _check_tokenizer_matches(ByteTokenizer(), out_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    ours = ByteTokenizer()
    # Byte soup: ids that are not valid UTF-8 decode to the same replacement characters, and
    # special ids (256..259) are dropped on both sides.
    token_ids = [104, 0xE6, 0x97, 105, 0xFF, 256, 33, 257, 0xF0, 0x9F]
    assert theirs.decode(token_ids, skip_special_tokens=True) == ours.decode(token_ids)
    assert theirs.model_max_length == 4096


def test_smollm2_export_counts_the_servers_tokens_and_renders_its_chat(
    smollm2_export: tuple[Path, Tokenizer],
) -> None:
    out_dir, ours = smollm2_export
    _check_tokenizer_matches(ours, out_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "What is 12 + 30?"},
    ]
    assert ours.chat_template is not None
    rendered = ours.chat_template.render(messages, add_generation_prompt=True)
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    # A rendered chat holds special tokens (<|im_start|>): they must encode to the same ids.
    assert theirs.encode(rendered) == ours.encode(rendered)


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_config_json_reads_back_unchanged(model: str, tmp_path: Path) -> None:
    out_dir = _export(model, tmp_path / model)
    exported = ModelConfig.from_file(out_dir / "config.json")
    assert exported == model_config_of(model)
    loaded = transformers.AutoConfig.from_pretrained(str(out_dir))
    assert (loaded.num_hidden_layers, loaded.vocab_size) == (exported.num_hidden_layers, exported.vocab_size)


def test_smollm2_config_json_reads_back_unchanged(smollm2_export: tuple[Path, Tokenizer]) -> None:
    out_dir, _ = smollm2_export
    source = resolve_model_source("smollm2-135m")
    assert source.path is not None
    assert ModelConfig.from_file(out_dir / "config.json") == GGUFCheckpoint.open(source.path).config


def test_tiny_weights_load_back_as_the_same_tensors(tmp_path: Path) -> None:
    out_dir = tmp_path / "tiny"
    completed = subprocess.run(
        [sys.executable, "-m", "beamsplit.cli", "model", "export", "--model", "tiny", "--weights", str(out_dir)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "model.safetensors" in completed.stdout
    model, config, tokenizer = load_model(out_dir)
    reference = build_tiny_model(config)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # Served from the export, beamsplit reads tokenizer.json and counts the same tokens.
    for text in TEXTS:
        assert tokenizer.encode(text) == ByteTokenizer().encode(text), text
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
