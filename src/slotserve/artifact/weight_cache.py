"""On-disk cache of a GGUF's dequantised weights, metadata and tokenizer.

Parsing GGUF metadata in Python and dequantising takes seconds; reading one safetensors
file takes a fraction of that. Entries are keyed by the SHA-256 of the GGUF's bytes and
carry a schema version; a stale or corrupt entry is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import platformdirs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

CACHE_SCHEMA = "1"


def cache_dir() -> Path:
    """``$SLOTSERVE_CACHE_DIR`` or the platform's user cache directory."""
    override = os.environ.get("SLOTSERVE_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("slotserve"))


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def entry_path(digest: str) -> Path:
    return cache_dir() / f"gguf-{digest[:32]}.safetensors"


def read_entry(digest: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Tensors and string metadata of a cache entry, or None if absent, stale or corrupt."""
    path = entry_path(digest)
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = dict(handle.metadata() or {})
        if meta.get("schema") != CACHE_SCHEMA or meta.get("digest") != digest:
            return None
        return load_file(str(path)), meta
    except (SafetensorError, OSError, ValueError):
        return None


def write_entry(digest: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write atomically (temp file + rename) so a crash never leaves a half entry."""
    path = entry_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(temp), metadata={**meta, "schema": CACHE_SCHEMA, "digest": digest})
    temp.replace(path)
