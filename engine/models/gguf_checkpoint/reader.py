"""A GGUF file's metadata and tensor table, read in one pass; the tensors stay memory-mapped.

`gguf`'s own GGUFReader keeps every metadata value as numpy views of the mapped file, one view per
string: a vocabulary of 49152 tokens and 48900 merges is ~250,000 views, 2.2 s of every worker's
start-up for SmolLM2-135M (measured, issue 29). Here the key/value section is decoded straight to
Python values (strings by `struct`, numeric arrays by one `np.frombuffer`), ~0.1 s for the same
file; the tensors get the arrays GGUFReader gives them (same dtype and shape: tests hold the two
readers equal on the packaged files). `gguf` still names the types and de-quantizes.

Format (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64
key/value count; each key/value: string key, u32 value type, value (strings: u64 length +
UTF-8; arrays: u32 item type, u64 count, items); each tensor: string name, u32 n_dims, u64 dims
(innermost first), u32 ggml type, u64 offset from the data section, which starts at the next
multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Scalar value types: struct format (little-endian) and numpy dtype
_SCALARS: dict[GGUFValueType, tuple[str, type[np.generic]]] = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
# Tensor types held as their own dtype (the rest are blocks of bytes)
_PLAIN_TENSORS: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it, innermost first
    data: np.ndarray  # the mapped bytes: [outer..., inner] in the type's dtype, or uint8 blocks


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> a scalar, a string, or a list of either (Python values)
    tensors: list[GGUFTensor]

    @classmethod
    def open(cls, path: Path | str) -> GGUFFile:
        """Raises ValueError naming what is wrong (magic, version, a truncated section, a type)."""
        mapped = np.memmap(path, mode="r")
        buffer = memoryview(mapped)  # type: ignore[arg-type]
        cursor = _Cursor(buffer)
        if bytes(buffer[:4]) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        cursor.offset = 4
        version = cursor.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS}, little-endian)"
            )
        num_tensors, num_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            fields[key] = cursor.value(GGUFValueType(cursor.scalar("<I")))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = cursor.scalar("<I")
            dims = tuple(cursor.scalar("<Q") for _ in range(num_dims))
            infos.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-cursor.offset // alignment) * alignment
        tensors, names = [], set()
        for name, dims, tensor_type, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name} is listed twice")
            names.add(name)
            tensors.append(_tensor(mapped, data_start + offset, name, dims, tensor_type))
        return cls(fields, tensors)


def _tensor(
    mapped: np.memmap, start: int, name: str, dims: tuple[int, ...], tensor_type: GGMLQuantizationType
) -> GGUFTensor:
    num_elements = int(np.prod(dims))
    outer_first = tuple(reversed(dims))
    if tensor_type in _PLAIN_TENSORS:
        dtype = np.dtype(_PLAIN_TENSORS[tensor_type])
        count, shape = num_elements, outer_first
    else:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        dtype = np.dtype(np.uint8)
        count, shape = (
            num_elements * type_size // block_size,
            quant_shape_to_byte_shape(outer_first, tensor_type),
        )
    end = start + count * dtype.itemsize
    if end > mapped.shape[0]:
        raise ValueError(f"tensor {name} runs past the end of the file ({end} > {mapped.shape[0]} bytes)")
    return GGUFTensor(name, tensor_type, dims, mapped[start:end].view(dtype).reshape(shape))


class _Cursor:
    """Reads little-endian values from `buffer`, moving `offset` past each."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error as error:
            raise ValueError(f"truncated at byte {self.offset}") from error
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"truncated string at byte {self.offset}")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8")
        self.offset = end
        return text

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type is GGUFValueType.STRING:
            return self.string()
        if value_type is GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if item_type is GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            if item_type is GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
            end = self.offset + count * dtype.itemsize
            if end > len(self.buffer):
                raise ValueError(f"truncated array at byte {self.offset}")
            items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset).tolist()
            self.offset = end
            return items
        return self.scalar(_SCALARS[value_type][0])
