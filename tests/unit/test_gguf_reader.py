"""engine/models/gguf_checkpoint/reader.py reads what `gguf`'s own GGUFReader reads: every metadata
value and every tensor's type, shape and mapped bytes, on a file written here with every value
type and on the packaged SmolLM2 file; what is not a GGUF file is refused naming why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, ReaderField
from gguf.quants import quantize

from engine.models.gguf_checkpoint.reader import GGUFFile
from engine.models.source import resolve_model_source


def reference_value(field: ReaderField) -> Any:
    """GGUFReader's field as Python values (its parts are numpy views of the file)."""
    if field.types[0] is GGUFValueType.ARRAY:
        if field.types[-1] is GGUFValueType.STRING:
            return [bytes(field.parts[index]).decode("utf-8") for index in field.data]
        return [field.parts[index].tolist()[0] for index in field.data]
    if field.types[0] is GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def assert_same_as_gguf(path: Path) -> GGUFFile:
    ours, reference = GGUFFile.open(path), GGUFReader(path)
    expected = {
        key: reference_value(field) for key, field in reference.fields.items() if not key.startswith("GGUF.")
    }
    assert ours.fields == expected
    assert [tensor.name for tensor in ours.tensors] == [tensor.name for tensor in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.tensor_type, mine.shape) == (theirs.tensor_type, tuple(theirs.shape.tolist())), mine.name
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape), mine.name
        assert np.array_equal(np.asarray(mine.data), np.asarray(theirs.data)), mine.name
    return ours


def test_every_value_type_and_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_float32("test.f32", 0.1)  # not exact in float32: both readers give its float32 value
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float64("test.f64", 1 / 3)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "héllo ▁wörld")
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.strings", ["a", "", "ü" * 40])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((4, 2)).astype(np.float16))
    blocks = quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks.q8", blocks, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_same_as_gguf(path)
    assert ours.fields["test.strings"] == ["a", "", "ü" * 40] and ours.fields["test.bool"] is True
    assert ours.fields["test.u64"] == 2**63 + 5 and ours.fields["general.alignment"] == 64
    q8 = next(tensor for tensor in ours.tensors if tensor.name == "blocks.q8")
    assert q8.shape == (64, 2) and q8.data.dtype == np.uint8 and q8.data.shape == (2, 68)


def test_packaged_smollm2_file() -> None:
    path = resolve_model_source("smollm2-135m").path
    assert path is not None
    ours = assert_same_as_gguf(path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def test_what_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="magic"):
        GGUFFile.open(path)
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 9"):
        GGUFFile.open(path)
    # A key/value count past what the file holds
    path.write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little")
    )
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile.open(path)
