"""GGUF loading: dequantisation checked against hand-written decoders of the block formats,
llama.cpp's Q/K permutation undone, and the weight cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

import slotserve as ss
from slotserve.artifact import load_gguf, weight_cache
from slotserve.artifact.gguf_file import (
    iter_tensors,
    model_info_from_gguf,
    open_gguf,
    read_metadata,
)
from slotserve.engine.probe import teacher_forced_logits
from slotserve.testing import write_tiny_gguf

KINDS = ("llama", "qwen2", "qwen3")


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(-1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    # Element j < 16 is the low nibble of byte j, element j + 16 its high nibble.
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)


def reference_dequant(kind: str, raw: np.ndarray) -> np.ndarray:
    """Independent decoders of ggml's block formats (32 values per block)."""
    if kind == "Q8_0":
        blocks = _blocks(raw, 34)
        return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)
    if kind == "Q4_0":
        blocks = _blocks(raw, 18)
        return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)
    if kind == "Q4_1":
        blocks = _blocks(raw, 20)
        return _f16(blocks, 0) * _nibbles(blocks[:, 4:]) + _f16(blocks, 2)
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32)
    if kind == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise AssertionError(kind)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantisation_matches_block_format(tmp_path: Path, qtype: str) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", qtype)
    ours = open_gguf(path)
    info = model_info_from_gguf(read_metadata(ours), {t.name for t in ours.tensors}, path)
    loaded = dict(iter_tensors(ours, info, path))
    checked = 0
    for tensor in GGUFReader(path).tensors:  # the raw blocks as gguf-py reads them
        if tensor.tensor_type.name != qtype:
            continue
        raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
        expected = reference_dequant(qtype, raw).reshape(tuple(reversed(tensor.shape)))
        ours = loaded[_hf(tensor.name)].numpy()
        np.testing.assert_array_equal(ours, expected)
        checked += 1
    assert checked > 10


def _hf(gguf_name: str) -> str:
    from slotserve.artifact.gguf_file import hf_tensor_name

    return hf_tensor_name(gguf_name, Path("x"))


@pytest.mark.parametrize("kind", KINDS)
def test_f32_gguf_equals_the_hf_model(
    tmp_path: Path, tiny_dirs: dict[str, Path], kind: str
) -> None:
    # The llama GGUF stores Q/K permuted the llama.cpp way; exact equality proves the
    # loader undoes it (and maps every tensor name).
    hf = ss.load(tiny_dirs[kind])
    gguf = write_tiny_gguf(tmp_path / "m.gguf", kind)
    gguf_model = load_gguf(gguf, use_cache=False, kernels=hf.kernels)  # the same attention
    ids = list(range(3, 60))
    torch.testing.assert_close(
        teacher_forced_logits(gguf_model, ids), teacher_forced_logits(hf, ids), rtol=0, atol=1e-5
    )
    assert gguf_model.tokenizer.encode("hi <|im_end|>") == hf.tokenizer.encode("hi <|im_end|>")
    assert gguf_model.tokenizer.render_chat([{"role": "user", "content": "x"}]) == (
        hf.tokenizer.render_chat([{"role": "user", "content": "x"}])
    )


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantised_gguf_stays_close_to_the_hf_model(
    tmp_path: Path, tiny_dirs: dict[str, Path], qtype: str
) -> None:
    hf = ss.load(tiny_dirs["llama"])
    quantised = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", "llama", qtype), use_cache=False)
    ours = quantised.weights.layers[0].qkv
    theirs = hf.weights.layers[0].qkv
    error = (ours.weight - theirs.weight).abs().max()  # type: ignore[attr-defined]
    scale = theirs.weight.abs().max()  # type: ignore[attr-defined]
    assert error < (0.01 if qtype == "Q8_0" else 0.15) * scale


def test_weight_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q4_1")
    first = load_gguf(path, progress=False)
    digest = weight_cache.file_digest(path)
    assert weight_cache.entry_path(digest).is_file()
    second = load_gguf(path, progress=False)
    ids = list(range(3, 30))
    torch.testing.assert_close(
        teacher_forced_logits(first, ids), teacher_forced_logits(second, ids), rtol=0, atol=0
    )
    assert second.info == first.info


def test_corrupt_cache_entry_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    load_gguf(path, progress=False)
    entry = weight_cache.entry_path(weight_cache.file_digest(path))
    entry.write_bytes(entry.read_bytes()[:100])
    model = load_gguf(path, progress=False)
    assert teacher_forced_logits(model, [3, 4, 5]).isfinite().all()
    assert weight_cache.read_entry(weight_cache.file_digest(path)) is not None
