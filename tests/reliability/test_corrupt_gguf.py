"""Corrupt GGUF metadata and tensor tables are refused with an `ArtifactError` naming the
file and the field, before anything is allocated or written to the cache (issue 9.7).

The files are real GGUFs from `write_tiny_gguf`, patched in place: a metadata value is
rewritten where its key is stored, a tensor dimension where the tensor table lists it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.artifact import load_gguf

# GGUF value types whose payload is a fixed-size number: type id -> struct format.
_NUMBER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 10: "<Q"}
_NUMBER_FORMATS |= {11: "<q", 12: "<d"}


def set_number(path: Path, key: str, value: float) -> None:
    """Overwrite the numeric metadata value stored under ``key`` (same type, same size)."""
    data = bytearray(path.read_bytes())
    stored = struct.pack("<Q", len(key)) + key.encode()
    at = data.find(stored)
    assert at >= 0, key
    at += len(stored)
    (kind,) = struct.unpack_from("<I", data, at)
    fmt = _NUMBER_FORMATS[kind]
    struct.pack_into(fmt, data, at + 4, value)
    path.write_bytes(bytes(data))


def set_tensor_dim(path: Path, name: str, axis: int, value: int) -> None:
    """Overwrite dimension ``axis`` (GGUF order: innermost first) of tensor ``name``."""
    data = bytearray(path.read_bytes())
    stored = struct.pack("<Q", len(name)) + name.encode()
    at = data.find(stored)
    assert at >= 0, name
    at += len(stored)
    (n_dims,) = struct.unpack_from("<I", data, at)
    assert axis < n_dims
    struct.pack_into("<Q", data, at + 4 + 8 * axis, value)
    path.write_bytes(bytes(data))


def _refused(path: Path, field: str, match: str) -> ss.ArtifactError:
    with pytest.raises(ss.ArtifactError, match=match) as err:
        load_gguf(path, progress=False)
    assert err.value.path == str(path)
    assert err.value.field == field
    return err.value


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("llama.attention.head_count", 0, "must be at least 1"),
        ("llama.attention.head_count_kv", 0, "must be at least 1"),
        ("llama.attention.head_count_kv", 3, "does not divide"),
        ("llama.embedding_length", 0, "must be at least 1"),
        ("llama.feed_forward_length", 0, "must be at least 1"),
        ("llama.context_length", 0, "must be at least 1"),
        ("llama.context_length", 1 << 31, "at most"),
        ("llama.block_count", 0, "must be at least 1"),
        ("llama.attention.layer_norm_rms_epsilon", -1.0, "must be > 0"),
        ("llama.attention.layer_norm_rms_epsilon", float("nan"), "must be > 0"),
        ("llama.rope.freq_base", 0.0, "must be > 0"),
        ("tokenizer.ggml.eos_token_id", 100000, "outside the vocabulary"),
    ],
)
def test_bad_metadata_value_is_an_artifact_error(
    cache: Path, gguf: Path, key: str, value: float, match: str
) -> None:
    set_number(gguf, key, value)
    _refused(gguf, key, match)
    assert not cache.exists() or not any(cache.iterdir())


def test_head_count_not_dividing_the_width(cache: Path, gguf: Path) -> None:
    # 64 wide, 3 heads and 3 KV heads, no key_length: the head width is not whole.
    set_number(gguf, "llama.attention.head_count", 3)
    set_number(gguf, "llama.attention.head_count_kv", 3)
    _refused(gguf, "llama.attention.head_count", "does not divide embedding_length=64")


def test_huge_block_count_fails_before_writing_the_cache(cache: Path, gguf: Path) -> None:
    set_number(gguf, "llama.block_count", 1_000_000)
    error = _refused(gguf, "llama.block_count", "1000000")
    assert "4" in str(error)  # the number of blocks the file really has
    assert not cache.exists() or not any(cache.iterdir())


def test_block_count_smaller_than_the_tensors(cache: Path, gguf: Path) -> None:
    set_number(gguf, "llama.block_count", 3)
    _refused(gguf, "llama.block_count", "blk.3")


def test_embedding_width_disagreeing_with_the_tensors(cache: Path, gguf: Path) -> None:
    set_number(gguf, "llama.embedding_length", 32)
    _refused(gguf, "llama.embedding_length", "token_embd.weight")


@pytest.mark.parametrize(
    ("tensor", "axis"),
    [("token_embd.weight", 0), ("token_embd.weight", 1), ("output_norm.weight", 0)],
)
def test_zero_tensor_dimension_names_the_file_and_tensor(
    cache: Path, gguf: Path, tensor: str, axis: int
) -> None:
    set_tensor_dim(gguf, tensor, axis, 0)
    _refused(gguf, tensor, "dimension")
    assert not cache.exists() or not any(cache.iterdir())


def test_overflowing_tensor_dimensions_are_refused(cache: Path, gguf: Path) -> None:
    # 2**33 * 2**31 elements wraps a 64-bit product to 0: it must not look like 0 bytes.
    set_tensor_dim(gguf, "token_embd.weight", 0, 1 << 33)
    set_tensor_dim(gguf, "token_embd.weight", 1, 1 << 31)
    _refused(gguf, "token_embd.weight", "bytes")


def test_quantised_row_not_a_whole_number_of_blocks(cache: Path, gguf: Path) -> None:
    set_tensor_dim(gguf, "blk.0.ffn_up.weight", 0, 48)  # Q8_0 blocks hold 32 values
    _refused(gguf, "blk.0.ffn_up.weight", "block")


def test_valid_file_still_loads(cache: Path, gguf: Path) -> None:
    model = load_gguf(gguf, progress=False)
    assert model.info.n_layers == 4 and model.info.n_heads == 4
