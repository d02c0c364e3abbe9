"""Fixtures of the reliability tests: a private weight-cache directory and a tiny GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.testing import write_tiny_gguf


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty weight cache of this test's own (``SLOTSERVE_CACHE_DIR``)."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    """A tiny Llama GGUF with Q8_0 weights."""
    return write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "Q8_0")
