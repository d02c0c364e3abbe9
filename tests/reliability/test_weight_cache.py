"""A tampered or broken weight-cache entry is rebuilt from the GGUF (with a warning that
names the cache file), never used to give a silently different answer (issue 9.5)."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.artifact import load_gguf, weight_cache
from slotserve.engine.probe import teacher_forced_logits
from slotserve.errors import ArtifactError

PROMPT = [3, 40, 41, 42, 100, 7, 9]


def _entry(gguf: Path) -> Path:
    return weight_cache.entry_path(weight_cache.file_digest(gguf))


def _header(entry: Path) -> tuple[int, bytes]:
    size = struct.unpack("<Q", entry.read_bytes()[:8])[0]
    return size, entry.read_bytes()[8 : 8 + size]


def _replace_in_header(entry: Path, old: bytes, new: bytes) -> None:
    """Same-length edit inside the safetensors JSON header: still a valid file."""
    assert len(old) == len(new)
    size, header = _header(entry)
    assert old in header, old
    data = entry.read_bytes()
    entry.write_bytes(data[:8] + header.replace(old, new, 1) + data[8 + size :])


def flip_data_bytes(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    for offset in range(len(data) - 4000, len(data) - 3000, 97):
        data[offset] ^= 0x5A
    entry.write_bytes(bytes(data))


def rename_tensor(entry: Path) -> None:
    _replace_in_header(entry, b'"model.norm.weight"', b'"model.norn.weight"')


def truncate(entry: Path) -> None:
    entry.write_bytes(entry.read_bytes()[:-5000])


def change_layer_count(entry: Path) -> None:
    """Fewer layers than the model has: every tensor still fits, so only the digest can
    tell that the answer would change."""
    _replace_in_header(entry, b'\\"n_layers\\": 4', b'\\"n_layers\\": 3')


def change_metadata_digest(entry: Path) -> None:
    _, header = _header(entry)
    digest = header.split(b'"digest":"')[1][:8]
    _replace_in_header(entry, b'"digest":"' + digest, b'"digest":"' + digest[::-1])


TAMPERINGS: list[Callable[[Path], None]] = [
    flip_data_bytes,
    rename_tensor,
    truncate,
    change_layer_count,
    change_metadata_digest,
]


def _logits(model: ss.Model) -> torch.Tensor:
    return teacher_forced_logits(model, PROMPT)


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=lambda f: f.__name__)
def test_tampered_entry_is_rebuilt_with_a_warning(
    cache: Path,
    gguf: Path,
    tamper: Callable[[Path], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh = _logits(load_gguf(gguf, progress=False))
    entry = _entry(gguf)
    assert entry.is_file()
    tamper(entry)
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        model = load_gguf(gguf, progress=False)
    assert torch.equal(_logits(model), fresh)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0], warnings
    # The entry was rewritten: the next load uses it, with no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        again = load_gguf(gguf, progress=False)
    assert not caplog.records
    assert torch.equal(_logits(again), fresh)


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=lambda f: f.__name__)
def test_read_entry_names_the_cache_file(
    cache: Path, gguf: Path, tamper: Callable[[Path], None]
) -> None:
    load_gguf(gguf, progress=False)
    entry = _entry(gguf)
    tamper(entry)
    with pytest.raises(ArtifactError) as err:
        weight_cache.read_entry(weight_cache.file_digest(gguf))
    assert err.value.path == str(entry) and err.value.field
    assert str(gguf) not in str(err.value)


def test_entry_that_verifies_but_cannot_build_weights_is_rebuilt(
    cache: Path, gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry whose digest matches (written by a buggy or other build, say) but whose
    tensors do not fit its ModelInfo: rebuilt, not an error blaming the GGUF."""
    fresh = _logits(load_gguf(gguf, progress=False))
    entry = _entry(gguf)
    digest = weight_cache.file_digest(gguf)
    cached = weight_cache.read_entry(digest)
    assert cached is not None
    tensors, meta = cached
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    user_meta = {k: v for k, v in meta.items() if k in ("model_info", "tokenizer")}
    weight_cache.write_entry(digest, tensors, user_meta)
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        model = load_gguf(gguf, progress=False)
    assert torch.equal(_logits(model), fresh)
    assert any(str(entry) in r.getMessage() for r in caplog.records)


def test_stale_schema_is_rebuilt_quietly(
    cache: Path, gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = _logits(load_gguf(gguf, progress=False))
    entry = _entry(gguf)
    schema = f'"schema":"{weight_cache.CACHE_SCHEMA}"'.encode()
    _replace_in_header(entry, schema, b'"schema":"0"')
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        model = load_gguf(gguf, progress=False)
    assert torch.equal(_logits(model), fresh)
    assert not caplog.records
    assert weight_cache.read_entry(weight_cache.file_digest(gguf)) is not None


def test_entry_records_what_it_was_written_with(cache: Path, gguf: Path) -> None:
    load_gguf(gguf, progress=False)
    cached = weight_cache.read_entry(weight_cache.file_digest(gguf))
    assert cached is not None
    tensors, meta = cached
    assert json.loads(meta["tensors"]) == weight_cache.tensor_manifest(tensors)
    assert meta["metadata_digest"] == weight_cache.metadata_digest(meta)


def test_unwritable_cache_warns_and_still_loads(
    tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        model = load_gguf(gguf, progress=False)
    assert torch.equal(_logits(model), _logits(load_gguf(gguf, use_cache=False)))
    assert any("not written" in r.getMessage() for r in caplog.records)
