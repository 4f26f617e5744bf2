"""A GGUF file's metadata and tensor table, read as the format lays them out (ggml's docs/gguf.md, versions 2 and 3):
what the lean backend reads of a file before it repacks the matrices. gguf's own `GGUFReader` makes a numpy view of
every metadata element, the tokenizer's ~150k tokens and ~150k merges among them: most of a Qwen GGUF's first load
on a 2-core CPU. Here an array is read in one piece (a string array by walking its lengths), and each tensor's data
is the view `GGUFReader` gives of it (its dtype and shape, from gguf's own tables), so either reader yields the same
matrices."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speculant.errors import ConfigError

SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
           12: "<f8"}  # GGUF value type -> little-endian numpy dtype
STRING, ARRAY = 8, 9
TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}  # tensor types whose data is a typed array; the others' is bytes (as GGUFReader gives them)
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the row length first
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray  # [..., rows, row] typed, or [..., rows, row bytes] for block-quantized types


class GGUFFile:
    """`fields`: every metadata key's value (int, float, bool, str or a list of them); `tensors`: the tensor table,
    each tensor's data a read-only view of the memory-mapped file."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = Path(path)
        self._memory = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._memory)
        if bytes(self._buffer[:4]) != b"GGUF":
            raise ConfigError(f"{self.path} is not a GGUF file")
        self._offset = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ConfigError(f"{self.path} is GGUF version {version} (or big-endian): speculant reads 2 and 3")
        tensor_count, field_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        table = []
        for _ in range(tensor_count):
            name = self._string()
            dims = struct.unpack_from(f"<{self._unpack('<I')}Q", self._buffer, self._offset)
            self._offset += 8 * len(dims)
            table.append((name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors: list[Tensor] = []
        for name, dims, ggml_type, offset in table:
            elements = int(np.prod(dims))
            block, size = GGML_QUANT_SIZES[ggml_type]
            n_bytes, shape = elements * size // block, tuple(reversed(dims))
            where = start + offset
            if ggml_type.name in TYPED:
                data = self._memory[where:where + n_bytes].view(TYPED[ggml_type.name]).reshape(shape)
            else:
                data = self._memory[where:where + n_bytes].reshape(quant_shape_to_byte_shape(shape, ggml_type))
            self.tensors.append(Tensor(name, ggml_type, dims, where, n_bytes, data))

    def _unpack(self, layout: str) -> Any:
        (value,) = struct.unpack_from(layout, self._buffer, self._offset)
        self._offset += struct.calcsize(layout)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = str(self._buffer[self._offset:self._offset + length], "utf-8", errors="replace")
        self._offset += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind in SCALARS:
            dtype = np.dtype(SCALARS[kind])
            value = np.frombuffer(self._buffer, dtype, 1, self._offset)[0]
            self._offset += dtype.itemsize
            return value.item()
        if kind == ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item in SCALARS:
                dtype = np.dtype(SCALARS[item])
                values = np.frombuffer(self._buffer, dtype, count, self._offset).tolist()
                self._offset += dtype.itemsize * count
                return values
            return [self._value(item) for _ in range(count)]
        raise ConfigError(f"{self.path}: a metadata value of unknown GGUF type {kind}")
