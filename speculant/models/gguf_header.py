"""A GGUF file's metadata and tensor table, read as the format lays them out (ggml's docs/gguf.md, versions 2 and 3,
little-endian): what the lean backend reads of a file before it repacks the matrices. gguf's own `GGUFReader` makes
a numpy view of every metadata element, hundreds of thousands for a tokenizer's tokens and merges; here an array is
read in one piece (a string array by walking its lengths). Each tensor's data is the view
`GGUFReader` gives of it (its dtype and shape, from gguf's own tables), so either reader yields the same matrices
(`same_as_gguf_reader`). Two values differ from `GGUFReader.contents()` by design: an array of arrays stays nested
(it flattens them), and a string that is not UTF-8 reads with replacement characters (it raises when asked)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from speculant.errors import ConfigError, ModelNotAvailable


def require_gguf() -> None:
    """Refuse, in one line with the command that installs it, to read GGUF files without the gguf package."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelNotAvailable("reading GGUF files needs the gguf package, which is not installed; run: pip install "
                                "gguf") from None


@cache
def _scalars() -> dict[int, np.dtype]:
    """GGUF value type -> the little-endian numpy dtype of its scalars (gguf's own table, byte order made explicit)."""
    from gguf import GGUFReader

    return {int(kind): np.dtype(numpy_type).newbyteorder("<")
            for kind, numpy_type in GGUFReader.gguf_scalar_to_np.items()}


TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
         "I64": np.int64}  # tensor types whose data GGUFReader gives as a typed array (the others': bytes)
MAX_NESTING = 8  # levels of arrays within arrays a header may have (GGUF files use one)


@dataclass(frozen=True, eq=False)
class Tensor:
    """One entry of a GGUF file's tensor table, with a read-only view of its data in the memory-mapped file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the row length first
    data_offset: int  # from the start of the file
    data: np.ndarray  # [..., rows, row] typed (F16, F32, F64, I8-I64), else [..., rows, row bytes]


class DamagedGGUF(ConfigError):
    """A GGUF file whose header cannot be read to its end (truncated, or sizes past the file): no backend reads it."""


class GGUFFile:
    """`fields`: every metadata key's value (int, float, bool, str or a list of them); `tensors`: the tensor table.
    A file that is not GGUF, whose header is cut short or repeats a name, or that holds a tensor of a type gguf does
    not know: ConfigError, one line (without the gguf package, whose tables name the types: ModelNotAvailable)."""

    def __init__(self, path: str | Path, until: Callable[[dict[str, Any]], bool] | None = None):
        """`until`: read the metadata only (no tensors), up to the first key after which `until(fields)` holds."""
        require_gguf()
        self._until = until
        self.path = Path(path)
        self._memory = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._memory)
        if bytes(self._buffer[:4]) != b"GGUF":
            raise ConfigError(f"{self.path} is not a GGUF file")
        try:
            self.tensors = self._read()
        except ConfigError:
            raise
        except (struct.error, ValueError, OverflowError) as error:  # past the end of the file, nested too deep
            raise DamagedGGUF(f"{self.path}: a damaged GGUF header ({error})") from None

    def _read(self) -> list[Tensor]:
        from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
        from gguf.quants import quant_shape_to_byte_shape

        self._offset = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ConfigError(f"{self.path} is GGUF version {version} (or big-endian): speculant reads 2 and 3")
        tensor_count, field_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            if key in self.fields:
                raise ConfigError(f"{self.path}: the GGUF key {key} appears twice")
            self.fields[key] = self._value(self._unpack("<I"))
            if self._until is not None and self._until(self.fields):
                break
        if self._until is not None:
            return []
        table: dict[str, tuple] = {}
        for _ in range(tensor_count):
            name = self._string()
            if name in table:
                raise ConfigError(f"{self.path}: the GGUF tensor {name} appears twice")
            dims = struct.unpack_from(f"<{self._unpack('<I')}Q", self._buffer, self._offset)
            self._offset += 8 * len(dims)
            table[name] = dims, self._tensor_type(name, self._unpack("<I")), self._unpack("<Q")
        alignment = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(f"{self.path}: a GGUF alignment of {alignment}, not a power of two")
        start = -(-self._offset // alignment) * alignment
        tensors = []
        for name, (dims, ggml_type, offset) in table.items():
            block, size = GGML_QUANT_SIZES[ggml_type]
            n_bytes, shape, where = int(np.prod(dims)) * size // block, tuple(reversed(dims)), start + offset
            data = self._memory[where:where + n_bytes]
            if ggml_type.name in TYPED:
                data = data.view(TYPED[ggml_type.name]).reshape(shape)
            else:
                data = data.reshape(quant_shape_to_byte_shape(shape, ggml_type))
            tensors.append(Tensor(name, ggml_type, dims, where, data))
        return tensors

    def _tensor_type(self, name: str, code: int) -> Any:
        """The gguf.GGMLQuantizationType numbered `code`; a ConfigError where gguf knows none (a type llama.cpp has
        removed, such as Q4_0_4_4, whose files it no longer reads either; or one newer than the gguf package)."""
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(code)
        except ValueError:
            raise ConfigError(f"{self.path}: the tensor {name} is of an unsupported tensor type ({code}; removed "
                              f"from llama.cpp, such as Q4_0_4_4, or unknown to gguf)") from None

    def _unpack(self, layout: str) -> Any:
        (value,) = struct.unpack_from(layout, self._buffer, self._offset)
        self._offset += struct.calcsize(layout)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        if self._offset + length > len(self._buffer):
            raise ValueError("a string past the end of the file")
        text = str(self._buffer[self._offset:self._offset + length], "utf-8", errors="replace")
        self._offset += length
        return text

    def _value(self, kind: int, depth: int = 0) -> Any:
        from gguf import GGUFValueType

        scalars = _scalars()
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in scalars:
            value = np.frombuffer(self._buffer, scalars[kind], 1, self._offset)[0]
            self._offset += value.itemsize
            return value.item()
        if kind == GGUFValueType.ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if count > len(self._buffer) - self._offset or depth >= MAX_NESTING:  # (an item takes a byte at least)
                raise ValueError("an array longer than the file, or nested too deep")
            if item in scalars:
                values = np.frombuffer(self._buffer, scalars[item], count, self._offset)
                self._offset += values.nbytes
                return values.tolist()
            if item == GGUFValueType.STRING:  # (a tokenizer's tokens and merges: the bulk of a header)
                return [self._string() for _ in range(count)]
            return [self._value(item, depth + 1) for _ in range(count)]
        raise ConfigError(f"{self.path}: a metadata value of unknown GGUF type {kind}")


def same_as_gguf_reader(path: str | Path) -> list[str]:
    """What `GGUFFile` reads differently from gguf's `GGUFReader` in the file at `path` (empty: nothing): every
    metadata value, and every tensor's name, type, shape, offset, size, dtype and data."""
    from gguf import GGUFReader

    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    differences = [f"field {key}" for key in expected.keys() | ours.fields.keys()
                   if key not in ours.fields or key not in expected or ours.fields[key] != expected[key]]
    if len(ours.tensors) != len(theirs.tensors):
        differences.append(f"{len(ours.tensors)} tensors, not {len(theirs.tensors)}")
    for mine, reference in zip(ours.tensors, theirs.tensors):
        if (mine.name, mine.tensor_type, mine.shape, mine.data_offset, mine.data.nbytes, mine.data.dtype,
                mine.data.shape) != (reference.name, reference.tensor_type, tuple(int(n) for n in reference.shape),
                                     reference.data_offset, reference.n_bytes, reference.data.dtype,
                                     reference.data.shape) or not np.array_equal(mine.data, reference.data):
            differences.append(f"tensor {mine.name}")
    return differences
