"""Byte surgery on GGUF files for the bad-file tests: where a key's value, an array's
count, a string's length or a tensor's table entry lies, and writing integers there."""

from __future__ import annotations

import struct
from pathlib import Path

HEADER_TENSOR_COUNT = 8  # after the magic and the version (uint32 each)
HEADER_KV_COUNT = 16
FIRST_KEY = 24


def value_at(data: bytes, key: str) -> int:
    """Where ``key``'s value starts (after its uint32 value type)."""
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name)
    return at + 8 + len(name) + 4


def array_count_at(data: bytes, key: str) -> int:
    """Where the element count of the array ``key`` lies (after its element type)."""
    return value_at(data, key) + 4


def array_element_at(data: bytes, key: str, index: int) -> int:
    """Where element ``index`` of the string array ``key`` starts (its uint64 length)."""
    at = array_count_at(data, key) + 8
    for _ in range(index):
        at += 8 + struct.unpack_from("<Q", data, at)[0]
    return at


def tensor_dims_at(data: bytes, name: str) -> int:
    """Where the tensor ``name``'s dimensions (uint64 each) start in the tensor table."""
    raw = name.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw)
    return at + 8 + len(raw) + 4


def tensor_offset_at(data: bytes, name: str) -> int:
    """Where the tensor ``name``'s data offset (uint64) lies in the tensor table."""
    dims = tensor_dims_at(data, name)
    n_dims = struct.unpack_from("<I", data, dims - 4)[0]
    return dims + 8 * n_dims + 4


def put_u64(path: Path, at: int, value: int) -> Path:
    data = bytearray(path.read_bytes())
    data[at : at + 8] = struct.pack("<Q", value)
    path.write_bytes(bytes(data))
    return path


def replace_bytes(path: Path, old: bytes, new: bytes, *, after: int = 0) -> Path:
    """Overwrite the first ``old`` at or after byte ``after`` with ``new`` (same length)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    at = data.index(old, after)
    path.write_bytes(data[:at] + new + data[at + len(new) :])
    return path


def gguf_string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv(key: bytes, value_type: int, payload: bytes) -> bytes:
    """One key/value pair: the key, its uint32 type, then ``payload`` (the encoded value)."""
    return gguf_string(key) + struct.pack("<I", value_type) + payload


def gguf_file(path: Path, pairs: list[bytes], *, version: int = 3, n_tensors: int = 0) -> Path:
    """A GGUF file of ``pairs`` (`gguf_kv`) and no tensor table, written by hand so that
    it can be wrong in ways gguf-py's writer refuses."""
    header = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(pairs))
    path.write_bytes(header + b"".join(pairs))
    return path
