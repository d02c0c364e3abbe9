"""On-disk cache of a GGUF's dequantised weights, metadata and tokenizer.

Parsing GGUF metadata in Python and dequantising takes seconds; reading one safetensors
file takes a fraction of that. Entries are keyed by the SHA-256 of the GGUF's bytes and
carry a schema version: an entry of another schema is stale and silently rewritten.

Each entry also records what it was written with: a checksum (CRC-32) of every tensor's
bytes with its dtype and shape, and a BLAKE2b digest of its metadata. Every read checks
both, so an entry changed on disk (flipped bits, a hand edit, a truncated copy) is never
used: `read_entry` raises an `ArtifactError` naming the cache file (and the tensor or key at
fault) and the caller rebuilds the entry. These detect damage, not forgery: whoever can
write the cache can also rewrite its checksums. CRC-32 because it keeps the check cheap
(zlib's is faster than a BLAKE2b digest of the same bytes), and every load checks the
whole entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from slotserve.errors import ArtifactError
from slotserve.paths import cache_dir

CACHE_SCHEMA = "2"  # 2: entries carry tensor checksums and a metadata digest
_RESERVED_KEYS = ("schema", "digest", "tensors", "metadata_digest")


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def entry_path(digest: str) -> Path:
    """Where the entry for the GGUF with SHA-256 ``digest`` lives."""
    return cache_dir() / f"gguf-{digest[:32]}.safetensors"


def tensor_manifest(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """``{name: [dtype, shape, crc32 of the bytes]}`` for every tensor, in name order."""
    return {
        name: [str(tensors[name].dtype), list(tensors[name].shape), _crc32(tensors[name])]
        for name in sorted(tensors)
    }


def _crc32(tensor: torch.Tensor) -> int:
    # A byte view of the tensor's storage: no copy for a contiguous tensor.
    return zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def metadata_digest(meta: Mapping[str, str]) -> str:
    """BLAKE2b of every metadata key and value but ``metadata_digest`` itself."""
    hasher = hashlib.blake2b(digest_size=16)
    for key in sorted(k for k in meta if k != "metadata_digest"):
        for field in (key.encode(), meta[key].encode()):
            # Length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
            hasher.update(len(field).to_bytes(8, "little") + field)
    return hasher.hexdigest()


def read_entry(digest: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """Tensors and string metadata of the entry for ``digest``, verified against what was
    recorded when it was written.

    Returns None when there is no entry or it is stale (another cache schema). Raises
    `ArtifactError` naming the cache file when the entry is unreadable, belongs to another
    GGUF, or differs from what was written.
    """
    path = entry_path(digest)
    if not path.exists():
        return None
    meta = _read_metadata(path)
    if meta.get("schema") != CACHE_SCHEMA:
        return None
    if meta.get("metadata_digest") != metadata_digest(meta):
        raise ArtifactError(
            path,
            "metadata differs from what was written (digest mismatch): the file was changed "
            "or damaged on disk",
            "metadata_digest",
        )
    if meta.get("digest") != digest:
        raise ArtifactError(
            path, f"entry was written for GGUF {meta.get('digest')!r}, not {digest}", "digest"
        )
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(path, f"cache entry unreadable ({exc})", "tensors") from exc
    _check_tensors(path, tensors, _recorded_manifest(path, meta))
    return tensors, meta


def _check_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], recorded: Mapping[str, Any]
) -> None:
    missing = sorted(recorded.keys() - tensors.keys())
    if missing:
        raise ArtifactError(path, "tensor recorded when written is missing", missing[0])
    unknown = sorted(tensors.keys() - recorded.keys())
    if unknown:
        raise ArtifactError(path, "tensor was not in the entry when written", unknown[0])
    for name, (dtype, shape, crc) in recorded.items():
        found = [str(tensors[name].dtype), list(tensors[name].shape), _crc32(tensors[name])]
        if found != [dtype, shape, crc]:
            raise ArtifactError(
                path,
                f"tensor differs from what was written: recorded {dtype}{shape} crc32 {crc}, "
                f"found {found[0]}{found[1]} crc32 {found[2]}",
                name,
            )


def _recorded_manifest(path: Path, meta: Mapping[str, str]) -> dict[str, Any]:
    try:
        manifest = json.loads(meta["tensors"])
    except (KeyError, ValueError) as exc:
        raise ArtifactError(path, f"no readable tensor manifest ({exc!r})", "tensors") from exc
    if not isinstance(manifest, dict):
        raise ArtifactError(path, "tensor manifest is not a JSON object", "tensors")
    return manifest


def _read_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(path, f"not a readable safetensors file ({exc})", "header") from exc


def write_entry(digest: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """Write the entry for ``digest`` with its content digest; return its path.

    Atomic (temp file + rename), so a crash never leaves a half entry."""
    reserved = [key for key in _RESERVED_KEYS if key in meta]
    if reserved:
        raise ValueError(f"metadata keys {reserved} are the cache's own; rename them")
    path = entry_path(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    full_meta = {
        **meta,
        "schema": CACHE_SCHEMA,
        "digest": digest,
        "tensors": json.dumps(tensor_manifest(tensors)),
    }
    full_meta["metadata_digest"] = metadata_digest(full_meta)
    temp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        save_file(tensors, str(temp), metadata=full_meta)
        temp.replace(path)
    finally:
        temp.unlink(missing_ok=True)  # after a failed write (a full disk, say)
    return path
