"""The GGUF container: header, key/value metadata and the tensor table, read from a crafted
file as safely as from a real one.

Every count and length the file declares (the tensor and key/value counts, each string's
length, each array's element count, a tensor's dimension count, its dimensions and its data
offset) is checked against the bytes left in the file before anything is read or allocated
for it, so a file never makes the reader allocate more than it holds: what is built is a
small multiple of the file's own size (Python lists of its values), however its fields lie.
A failure is an `ArtifactError` naming the file, the field (the key, ``key[index]`` inside
an array, or the tensor), the declared value and the bytes left.

Strings are UTF-8 in GGUF, but llama.cpp stores them as bytes and never checks; here a
string that is not UTF-8 is returned as its ``bytes`` (a valid one as ``str``), for the
caller to refuse or keep (`slotserve.artifact.gguf_file.read_metadata`). Keys and tensor
names must be UTF-8. Tensor data stays in the file's memory map: each `GGUFTensor`'s
``data`` is a numpy view laid out as gguf-py lays it out (typed for float and integer
types, the blocks' bytes for quantised ones), so `gguf.quants.dequantize` reads it.

Owns only the byte format; it knows nothing of architectures, tokenizers or quantisation
support (`gguf_file` checks those).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from slotserve.errors import ArtifactError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; gguf-py and llama.cpp read 2 and 3
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# The smallest key/value pair: a key length, a value type and a one-byte value.
_MIN_KV_BYTES = 8 + 4 + 1
# The smallest tensor-table entry: a name length, a dimension count, a type and an offset.
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8

_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's length
# GGUF value type -> (name, struct format, numpy dtype) for the fixed-size types.
_SCALARS: dict[int, tuple[str, str, str]] = {
    0: ("uint8", "<B", "<u1"),
    1: ("int8", "<b", "<i1"),
    2: ("uint16", "<H", "<u2"),
    3: ("int16", "<h", "<i2"),
    4: ("uint32", "<I", "<u4"),
    5: ("int32", "<i", "<i4"),
    6: ("float32", "<f", "<f4"),
    7: ("bool", "<?", "?"),
    10: ("uint64", "<Q", "<u8"),
    11: ("int64", "<q", "<i8"),
    12: ("float64", "<d", "<f8"),
}
_UINT32 = 4
# Tensor types gguf-py maps as typed numpy arrays (all others: their blocks' bytes).
_TYPED = {
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
    """One tensor: ``shape`` innermost dimension first (as the file lists it), ``data`` a
    view into the file's memory map."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray[Any, Any]


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (in file order; strings as `str`, or `bytes` where they are
    not UTF-8) and tensors (in file order), read by `read_gguf`."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int
    size: int


def read_gguf(path: Path, *, values: bool = True) -> GGUFFile:
    """Read ``path``'s header, metadata and tensor table; the tensor data is mapped, not read.
    ``values`` False: every metadata value is checked against the file as ever but skipped,
    not made into Python objects (a tokenizer's 10^5 strings), except ``general.alignment``
    (the tensors' offsets need it): the metadata holds that key alone, if the file has it.

    Refuses (`ArtifactError`) a file without the GGUF magic, of another version or byte
    order, any declared size beyond the bytes left, an unknown value or tensor type, nested
    arrays (llama.cpp refuses them too), duplicate keys or tensor names, a bad
    ``general.alignment``, and a tensor whose shape or data does not fit the file."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
        data = np.memmap(path, dtype=np.uint8, mode="r") if magic == MAGIC else None
    except OSError as exc:
        raise ArtifactError(path, f"cannot read the file ({exc.strerror})") from exc
    if data is None:
        raise ArtifactError(path, f"not a GGUF file: magic is {magic!r}, expected b'GGUF'", "magic")
    return _Reader(path, data, values).read()


def utf8_error(raw: bytes) -> str:
    """Why ``raw`` is not UTF-8, in words: the reason and the first invalid byte's offset."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"{exc.reason}: byte 0x{raw[exc.start]:02x} at offset {exc.start} of {len(raw)}"
    return "valid UTF-8"


class _Reader:
    """A cursor over the mapped file; every read is checked against the bytes left."""

    def __init__(self, path: Path, data: np.ndarray[Any, Any], values: bool = True) -> None:
        self.path = path
        self.values = values  # False: metadata values are skipped (`read_gguf`)
        self.data = data
        self.buffer = data.data  # a memoryview, for struct
        self.size = len(data)
        self.pos = 4  # after the magic

    def read(self) -> GGUFFile:
        version = self._unpack("<I", "the version", "version")
        if version & 0xFFFF == 0 and version:
            raise ArtifactError(
                self.path, "is a big-endian GGUF file; only little-endian files are read", "version"
            )
        if version not in VERSIONS:
            raise ArtifactError(
                self.path,
                f"GGUF version {version} is not supported; supported: {VERSIONS} "
                "(convert the model again with a current llama.cpp)",
                "version",
            )
        n_tensors = self._unpack("<Q", "the tensor count", "tensor_count")
        n_kv = self._unpack("<Q", "the key/value count", "kv_count")
        self._fits(n_kv, _MIN_KV_BYTES, "key/value pairs", "kv_count")
        self._fits(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor infos", "tensor_count")
        least = n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES
        if least > self._left():
            raise self._refuse(
                f"declares {n_kv} key/value pairs and {n_tensors} tensor infos (at least "
                f"{least} bytes)",
                "tensor_count",
            )
        metadata = self._metadata(n_kv)
        alignment = self._alignment(metadata)
        infos = [self._tensor_info(index, n_tensors) for index in range(n_tensors)]
        data_offset = self.pos + (-self.pos) % alignment
        tensors = self._tensors(infos, data_offset)
        return GGUFFile(self.path, version, metadata, tensors, alignment, data_offset, self.size)

    # -- primitives -------------------------------------------------------------------------

    def _left(self) -> int:
        return self.size - self.pos

    def _refuse(self, declared: str, field: str) -> ArtifactError:
        return ArtifactError(
            self.path,
            f"{declared} but {self._left()} bytes are left in the file after byte {self.pos} "
            "(truncated file, or corrupt header?)",
            field,
        )

    def _fits(self, count: int, item_bytes: int, what: str, field: str) -> None:
        """``count`` items of at least ``item_bytes`` each fit in the bytes left."""
        if count * item_bytes > self._left():
            raise self._refuse(
                f"declares {count} {what} (at least {item_bytes} bytes each: "
                f"{count * item_bytes} bytes)",
                field,
            )

    def _take(self, n: int, declared: str, field: str) -> int:
        """Advance past ``n`` bytes (what ``declared`` says they are), returning where they
        start."""
        if n > self._left():
            raise self._refuse(declared, field)
        start = self.pos
        self.pos += n
        return start

    def _unpack(self, fmt: str, what: str, field: str) -> Any:
        size = struct.calcsize(fmt)
        start = self._take(size, f"needs {size} bytes for {what}", field)
        return struct.unpack_from(fmt, self.buffer, start)[0]

    def _string(self, field: str) -> str | bytes:
        return self._strings(1, lambda _: field)[0]

    def _text(self, field: str, what: str) -> str:
        """A string that must be UTF-8 (a key, a tensor name)."""
        text = self._string(field)
        if isinstance(text, bytes):
            raise ArtifactError(
                self.path, f"{what} {text[:64]!r} is not UTF-8 ({utf8_error(text)})", field
            )
        return text

    # -- metadata ---------------------------------------------------------------------------

    def _metadata(self, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        keys: set[str] = set()  # every key read, kept or not
        for index in range(n_kv):
            key = self._text(f"key {index} of {n_kv}", "the key")
            if key in keys:
                raise ArtifactError(self.path, "appears twice in the metadata", key)
            keys.add(key)
            value_type = self._unpack("<I", "a value type", key)
            if key == "general.alignment" and value_type != _UINT32:
                raise ArtifactError(self.path, f"has value type {value_type}, not uint32", key)
            keep = self.values or key == "general.alignment"
            value = self._value(value_type, key, keep)
            if keep:
                metadata[key] = value
        return metadata

    def _value(self, value_type: int, key: str, keep: bool = True) -> Any:
        """The value at the cursor; ``keep`` False: checked and skipped (None)."""
        if value_type == _STRING:
            strings = self._strings(1, lambda _: key, keep)
            return strings[0] if keep else None
        if value_type == _ARRAY:
            return self._array(key, keep)
        if value_type not in _SCALARS:
            raise ArtifactError(self.path, f"unknown GGUF value type {value_type}", key)
        name, fmt, _ = _SCALARS[value_type]
        return self._unpack(fmt, f"a {name} value", key)

    def _array(self, key: str, keep: bool = True) -> list[Any]:
        item_type = self._unpack("<I", "an array's element type", key)
        count = self._unpack("<Q", "an array's element count", key)
        if item_type == _STRING:
            self._fits(count, 8, "string elements", key)  # each has its 8-byte length
            return self._strings(count, lambda index: f"{key}[{index}]", keep)
        if item_type == _ARRAY:
            raise ArtifactError(self.path, "is an array of arrays; GGUF readers refuse them", key)
        if item_type not in _SCALARS:
            raise ArtifactError(self.path, f"unknown GGUF array element type {item_type}", key)
        name, fmt, dtype = _SCALARS[item_type]
        size = struct.calcsize(fmt)
        declared = f"declares {count} {name} elements ({count * size} bytes)"
        start = self._take(count * size, declared, key)
        if not keep:
            return []
        values: list[Any] = np.frombuffer(self.data, dtype, count, start).tolist()
        return values

    def _strings(
        self, count: int, field: Callable[[int], str], keep: bool = True
    ) -> list[str | bytes]:
        """``count`` strings, each its 8-byte length then its bytes: `str` where they are
        UTF-8, else the `bytes` (none made where not ``keep``: only their lengths are
        checked). String ``index`` is named ``field(index)`` in an error, made only then:
        one loop over a tokenizer's vocabulary (10^5 strings) checks each."""
        buffer, size, pos = self.buffer, self.size, self.pos
        length_at = _LENGTH.unpack_from
        strings: list[str | bytes] = []
        for index in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self._refuse("needs 8 bytes for a string length", field(index))
            (length,) = length_at(buffer, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                raise self._refuse(f"declares a string of {length} bytes", field(index))
            start, pos = pos, pos + length
            if not keep:
                continue
            raw = buffer[start:pos]
            try:
                strings.append(str(raw, "utf-8"))
            except UnicodeDecodeError:
                strings.append(bytes(raw))
        self.pos = pos
        return strings

    def _alignment(self, metadata: dict[str, Any]) -> int:
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment < 1 or alignment & (alignment - 1):
            raise ArtifactError(
                self.path, f"is {alignment}; must be a power of two", "general.alignment"
            )
        return int(alignment)

    # -- tensors ----------------------------------------------------------------------------

    def _tensor_info(self, index: int, count: int) -> tuple[str, list[int], int, int]:
        name = self._text(f"tensor {index} of {count}", "the tensor name")
        n_dims = self._unpack("<I", "a dimension count", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ArtifactError(
                self.path, f"has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}", name
            )
        dims = [self._unpack("<Q", "a dimension", name) for _ in range(n_dims)]
        raw_type = self._unpack("<I", "a tensor type", name)
        offset = self._unpack("<Q", "a data offset", name)
        return name, dims, raw_type, offset

    def _tensors(
        self, infos: list[tuple[str, list[int], int, int]], data_offset: int
    ) -> list[GGUFTensor]:
        tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ArtifactError(self.path, "appears twice in the tensor table", name)
            names.add(name)
            tensors.append(self._tensor(name, dims, raw_type, (data_offset, offset)))
        return tensors

    def _tensor(
        self, name: str, dims: list[int], raw_type: int, where: tuple[int, int]
    ) -> GGUFTensor:
        """A tensor whose type is known, whose dimensions are at least 1 and whole blocks,
        and whose data lies inside the file; ``where`` is the data section's start and the
        tensor's offset in it (sizes in Python integers: a numpy product of huge dimensions
        would wrap)."""
        data_offset, offset = where
        start = data_offset + offset
        try:
            kind = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise ArtifactError(self.path, f"unknown ggml tensor type {raw_type}", name) from None
        for axis, size in enumerate(dims):
            if size < 1:
                raise ArtifactError(
                    self.path, f"dimension {axis} is {size}; must be at least 1", name
                )
        if dims[0] % block:
            raise ArtifactError(
                self.path,
                f"rows of {dims[0]} values are not a whole number of {kind.name} blocks of {block}",
                name,
            )
        n_elements = math.prod(dims)
        n_bytes = n_elements // block * type_size
        if start + n_bytes > self.size:
            left = max(self.size - start, 0)
            raise ArtifactError(
                self.path,
                f"declares dimensions {dims} of {kind.name} ({n_bytes} bytes) at data offset "
                f"{offset} (byte {start}) but {left} bytes are left there in the file of "
                f"{self.size} bytes (truncated file, or corrupt dimensions or offset?)",
                name,
            )
        shape = tuple(reversed(dims))
        typed = _TYPED.get(kind)
        raw = self.data[start : start + n_bytes]
        if typed is not None:
            data = raw.view(typed).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, tuple(dims), n_elements, n_bytes, start, data)
