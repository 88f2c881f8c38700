"""A tied embedding kept as Q8_0 rows (engine/models/q8_embedding.py): same bits as the dense matrix
gguf de-quantizes, in every dtype, and the model is left alone where they differ."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from engine.models.loader import build_tiny_model, tiny_hybrid_model_config, tiny_model_config
from engine.models.q8_embedding import Q8Embedding, Q8Rows, embedding_dtype, untie_as_q8


def q8_matrix(rows: int, width: int, seed: int = 0) -> tuple[Q8Rows, torch.Tensor]:
    """Random values quantized to Q8_0 by gguf: the rows as a file stores them, and gguf's own
    de-quantization of them [rows, width] float32."""
    values = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    blocks = quantize(values, GGMLQuantizationType.Q8_0)  # [rows, width / 32 * 34] uint8
    dense = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).copy())
    return Q8Rows.from_blocks(torch.from_numpy(blocks.copy())), dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rows_equal_gguf_dequantization_cast_to_the_dtype(dtype: torch.dtype) -> None:
    rows, dense = q8_matrix(300, 96)
    embedding = Q8Embedding(rows, dtype)
    ids = torch.tensor([0, 299, 7, 7, 150])
    assert torch.equal(embedding(ids), dense[ids].to(dtype))
    assert torch.equal(embedding.weight, dense.to(dtype))
    assert embedding_dtype(embedding) == dtype
    # model.to() casts the output dtype, never the integer codes or the float16 scales' bits.
    moved = embedding.to(torch.float32)
    assert moved.codes.dtype == torch.int8 and moved.scale_bits.dtype == torch.int16
    assert torch.equal(moved(ids), dense[ids])


def test_a_row_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 34"):
        Q8Rows.from_blocks(torch.zeros(4, 35, dtype=torch.uint8))


def tied_model_with_q8_embedding(hybrid: bool = False) -> tuple[torch.nn.Module, Q8Rows]:
    config = tiny_hybrid_model_config() if hybrid else replace(tiny_model_config(), tie_word_embeddings=True)
    model = build_tiny_model(config)
    rows, dense = q8_matrix(config.vocab_size, config.hidden_size, seed=1)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(dense)  # the head shares it
    assert model.lm_head.weight is model.embed_tokens.weight
    return model, rows


@pytest.mark.parametrize("hybrid", [False, True])
def test_untie_keeps_the_outputs_and_gives_the_head_its_own_weight(hybrid: bool) -> None:
    model, rows = tied_model_with_q8_embedding(hybrid)
    dense = model.embed_tokens.weight.detach().clone()
    ids = torch.arange(model.config.vocab_size)
    assert untie_as_q8(model, rows)
    assert isinstance(model.embed_tokens, Q8Embedding)
    assert torch.equal(model.embed_tokens(ids), dense)
    assert torch.equal(model.lm_head.weight, dense)
    assert model.dtype == torch.float32
    assert torch.equal(model.state_dict()["embed_tokens.weight"], dense)
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens(ids), dense.to(torch.bfloat16))


def test_rows_one_bit_off_leave_the_model_tied() -> None:
    model, rows = tied_model_with_q8_embedding()
    codes = rows.codes.clone()
    codes[5, 3] += 1
    assert not untie_as_q8(model, Q8Rows(codes, rows.scales))
    assert isinstance(model.embed_tokens, torch.nn.Embedding)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_rows_equal_in_value_but_not_in_bits_leave_the_model_tied() -> None:
    model, rows = tied_model_with_q8_embedding()
    with torch.no_grad():
        model.embed_tokens.weight[4, :] = -0.0  # the codes rebuild +0.0 there: equal values
    zeroed = rows.codes.clone()
    zeroed[4] = 0
    assert not untie_as_q8(model, Q8Rows(zeroed, rows.scales))
    assert model.lm_head.weight is model.embed_tokens.weight


def test_an_untied_model_or_no_rows_is_left_alone() -> None:
    model = build_tiny_model(tiny_model_config())  # head not tied
    rows, _ = q8_matrix(model.config.vocab_size, model.config.hidden_size)
    assert not untie_as_q8(model, rows)
    tied, _ = tied_model_with_q8_embedding()
    assert not untie_as_q8(tied, None)
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and isinstance(
        tied.embed_tokens, torch.nn.Embedding
    )


def test_from_dense_finds_the_blocks_of_a_dequantized_matrix() -> None:
    rows, dense = q8_matrix(300, 96, seed=2)
    found = Q8Rows.from_dense(dense)
    assert found is not None
    assert torch.equal(found.codes, rows.codes)
    assert torch.equal(found.scales.view(torch.int16), rows.scales.view(torch.int16))


def test_from_dense_refuses_what_is_not_exactly_q8() -> None:
    _, dense = q8_matrix(64, 64, seed=3)
    assert Q8Rows.from_dense(torch.randn(64, 64)) is None  # float32 values, not int8 blocks
    nudged = dense.clone()
    nudged[10, 7] = torch.nextafter(nudged[10, 7], torch.tensor(float("inf")))  # one ulp
    assert Q8Rows.from_dense(nudged) is None
    signed_zero = dense.clone()
    signed_zero[3, :32] = 0.0
    signed_zero[3, 5] = -0.0  # rebuilds as +0.0: equal values, other bits
    assert Q8Rows.from_dense(signed_zero) is None
    assert Q8Rows.from_dense(dense.to(torch.bfloat16)) is None  # only a float32 checkpoint's values
    assert Q8Rows.from_dense(dense[:, :40]) is None  # not whole blocks


def test_a_float32_checkpoint_directory_with_q8_exact_rows_is_untied(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engine.models.loader import load_model
    from tests.helpers.checkpoints import write_random_llama_checkpoint

    directory = write_random_llama_checkpoint(tmp_path / "tied", tie_word_embeddings=True, hidden_size=64)
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(str(file))
    _, dense = q8_matrix(*tensors["model.embed_tokens.weight"].shape, seed=4)
    tensors["model.embed_tokens.weight"] = dense
    save_file(tensors, str(file), metadata={"format": "pt"})
    plain, _, _ = load_model(directory, "bfloat16")
    compact, _, _ = load_model(directory, "bfloat16", compact_tied_embedding=True)
    assert isinstance(plain.embed_tokens, torch.nn.Embedding)
    assert isinstance(compact.embed_tokens, Q8Embedding)
    ids = torch.arange(dense.shape[0])
    assert torch.equal(compact.embed_tokens(ids), plain.embed_tokens(ids))
    assert torch.equal(compact.lm_head.weight, plain.lm_head.weight)
    random_rows = write_random_llama_checkpoint(tmp_path / "random", tie_word_embeddings=True, hidden_size=64)
    kept, _, _ = load_model(random_rows, "float32", compact_tied_embedding=True)
    assert isinstance(kept.embed_tokens, torch.nn.Embedding)  # its float32 rows are no Q8_0 blocks
