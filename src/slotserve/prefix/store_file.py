"""One file of the prefix store (`slotserve.prefix.store`): a KV snapshot as an artifact
with a contract.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (JSON), the
payload (the pool's `PayloadPart` tensors, raw, in order). The header holds the schema
version, the model fingerprint (`ModelFingerprint`: weights digest, weight format, numerics
version), the KV layout (`KVPool.kv_identity`: layout, dtype, block size, every layer
group), the token ids, the retention state (the high-water mark of every ring), the
payload's parts, size and SHA-256, and the SHA-256 of the header itself (`encode_header`).
`read_header` checks a file's header against this store's `StoreIdentity` and raises
`Refused` with the reason of the first check it fails (`REFUSAL_REASONS`; ``not_a_file``:
a symbolic link, a FIFO, a device or a directory with the store's suffix, which is never
opened for reading: a FIFO would block its reader forever); `payload_parts`
reads a payload back, checking its SHA-256 once the last part is read; `write_file` writes
a file a part at a time and fsyncs it (the store writes it under a temporary name and
renames it).

Owns the format. Must not touch the index, the writer's queue or the pool.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from slotserve.kv.pool import PayloadPart
from slotserve.prefix.fingerprint import ModelFingerprint

SCHEMA = 1
MAGIC = b"SLOTKV\r\n"
SUFFIX = ".kvsnap"
TMP_PREFIX = ".tmp-"
PREAMBLE = len(MAGIC) + 8
MAX_HEADER_BYTES = 64 << 20
# The payload digest a header is first written with (`write_file`): any 64 hex digits.
PLACEHOLDER_SHA256 = "0" * 64
REFUSAL_REASONS = (
    "schema", "model", "numerics", "layout", "checksum", "retention", "not_a_file",
)  # fmt: skip
DTYPES = {
    str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)
}


class Refused(Exception):
    """A file that fails a check, with the reason (one of `REFUSAL_REASONS`) counted for it."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REFUSAL_REASONS, reason
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class StoreIdentity:
    """What this store's files must have been computed with: the model's fingerprint, the
    pool's KV identity and payload parts (`KVPool.kv_identity`, `KVPool.payload_parts`)."""

    fingerprint: ModelFingerprint
    kv: dict[str, Any]
    parts: tuple[PayloadPart, ...]

    def part_specs(self, length: int) -> list[list[Any]]:
        """``[name, dtype, shape]`` of every payload part of a snapshot of ``length``."""
        return [[p.name, p.dtype, list(p.shape(length))] for p in self.parts]

    def file_name(self, tokens: Sequence[int]) -> str:
        """The file of ``tokens``' snapshot: one per token sequence and identity."""
        digest = hashlib.sha256(canonical([self.fingerprint.to_json(), self.kv]))
        digest.update(canonical(list(tokens)))
        return digest.hexdigest()[:32] + SUFFIX


@dataclass
class StoreEntry:
    """One indexed file: ``tokens``' snapshot, written up to ``high_water``; ``nbytes`` the
    file's size, the payload from byte ``payload_at``."""

    key: int
    name: str
    tokens: tuple[int, ...]
    high_water: int
    nbytes: int
    payload_at: int
    parts: list[list[Any]]
    payload_sha256: str


def read_header(path: Path, identity: StoreIdentity, key: int) -> StoreEntry:
    """The header of the file at ``path``, checked against ``identity`` (this model, numerics,
    pool and schema), as an index entry numbered ``key``; `Refused` with the reason of the
    first check it fails."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(PREAMBLE)
        if len(head) < PREAMBLE or head[: len(MAGIC)] != MAGIC:
            if len(head) < PREAMBLE and MAGIC.startswith(head[: len(MAGIC)]):
                raise Refused("checksum", "truncated inside its preamble")
            raise Refused("schema", "not a slotserve prefix-store file")
        length = int.from_bytes(head[len(MAGIC) :], "little")
        if length > min(MAX_HEADER_BYTES, size - PREAMBLE):
            raise Refused("checksum", f"a header of {length} bytes in a {size}-byte file")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
        schema = header["schema"] if isinstance(header, dict) else None
    except (ValueError, KeyError):
        raise Refused("checksum", "the header is not readable JSON") from None
    if schema != SCHEMA:
        raise Refused("schema", f"schema {schema!r}, this runtime reads {SCHEMA}")
    try:
        return _check_header(header, identity, path.name, size, PREAMBLE + length, key)
    except (AttributeError, TypeError, KeyError, ValueError) as exc:  # signed, yet malformed
        raise Refused("checksum", f"a malformed header ({exc!r})") from None


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file, not a symbolic link; `Refused`
    (``not_a_file``) otherwise. Opened without following a link and without blocking (a
    FIFO opens at once, then is refused), so nothing swapped in after a listing can block
    or redirect the reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link
            raise Refused("not_a_file", "a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Refused("not_a_file", f"not a regular file (mode {stat.filemode(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_header(
    header: dict[str, Any], identity: StoreIdentity, name: str, size: int, payload_at: int,
    key: int,
) -> StoreEntry:  # fmt: skip
    claimed = header.pop("header_sha256", None)
    if claimed != hashlib.sha256(canonical(header)).hexdigest():
        raise Refused("checksum", "the header does not match its SHA-256")
    ours, theirs = identity.fingerprint, header.get("fingerprint", {})
    for facet in ("model_sha256", "weight_format"):
        if theirs.get(facet) != getattr(ours, facet):
            found, wanted = theirs.get(facet), getattr(ours, facet)
            raise Refused("model", f"{facet} {found!r}, this model's {wanted!r}")
    if theirs.get("numerics") != ours.numerics:
        found = theirs.get("numerics")
        raise Refused("numerics", f"numerics {found!r}, this runtime's {ours.numerics!r}")
    if header.get("kv") != identity.kv:
        raise Refused("layout", f"KV {header.get('kv')}, this pool's {identity.kv}")
    tokens, retention = header.get("tokens"), header.get("retention", {})
    if not isinstance(tokens, list) or not tokens:
        raise Refused("checksum", "no token ids")
    high_water = retention.get("high_water")
    rings = [g for g in identity.kv["groups"] if g["kind"] == "ring"]
    expected_rings = [{**g, "high_water": high_water} for g in rings]
    if (
        not isinstance(high_water, int)
        or high_water < len(tokens)
        or retention.get("rings") != expected_rings
    ):
        raise Refused("retention", f"retention state {retention} for {len(tokens)} tokens")
    payload = header.get("payload", {})
    if payload.get("parts") != identity.part_specs(len(tokens)):
        raise Refused("layout", "payload parts differ from this pool's")
    if size != payload_at + payload.get("nbytes", -1):
        claims = f"{payload_at} + {payload.get('nbytes')}"
        raise Refused("checksum", f"{size} bytes, the header says {claims}")
    return StoreEntry(
        key, name, tuple(tokens), high_water, size, payload_at,
        payload["parts"], payload["sha256"],
    )  # fmt: skip


def encode_header(
    identity: StoreIdentity, tokens: Sequence[int], high_water: int, parts: list[list[Any]],
    nbytes: int, sha256: str, written_unix: float | None = None,
) -> bytes:  # fmt: skip
    """The header of a file of ``tokens``' snapshot (written up to ``high_water``) whose
    payload is ``parts``, ``nbytes`` long with SHA-256 ``sha256``, signed with its own. Its
    length depends on neither digest (both are 64 hex digits), so a writer may write it
    for a placeholder digest and again, in place, once the payload's is known."""
    rings = [g for g in identity.kv["groups"] if g["kind"] == "ring"]
    header: dict[str, Any] = {
        "schema": SCHEMA,
        "fingerprint": identity.fingerprint.to_json(),
        "kv": identity.kv,
        "tokens": list(tokens),
        "retention": {
            "high_water": high_water,
            "rings": [{**g, "high_water": high_water} for g in rings],
        },
        "payload": {"parts": parts, "nbytes": nbytes, "sha256": sha256},
        "written_unix": round(time.time() if written_unix is None else written_unix, 3),
    }
    header["header_sha256"] = hashlib.sha256(canonical(header)).hexdigest()
    return json.dumps(header, separators=(",", ":")).encode()


def part_nbytes(spec: Sequence[Any]) -> int:
    """Bytes of the payload part ``[name, dtype, shape]``."""
    _name, dtype, shape = spec
    count = 1
    for dim in shape:
        count *= dim
    return count * torch.empty((), dtype=DTYPES[dtype]).element_size()


def payload_parts(handle: Any, entry: StoreEntry) -> Iterator[torch.Tensor]:
    """The payload's tensors, read in order; raises `Refused` ("checksum") once the last
    is read if the payload is short, longer or does not match its SHA-256."""
    digest = hashlib.sha256()
    for name, dtype, shape in entry.parts:
        buffer = bytearray(part_nbytes((name, dtype, shape)))
        if handle.readinto(buffer) != len(buffer):
            raise Refused("checksum", f"truncated in part {name}")
        digest.update(buffer)
        yield torch.frombuffer(buffer, dtype=DTYPES[dtype]).view(shape)
    if handle.read(1):
        raise Refused("checksum", "bytes past the payload")
    if digest.hexdigest() != entry.payload_sha256:
        raise Refused("checksum", "the payload does not match its SHA-256")


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def write_file(
    path: Path, header: Callable[[str], bytes], payload: Iterable[bytes | memoryview]
) -> str:
    """A new file at ``path``: `MAGIC`, the header's length, ``header(sha256)`` for the
    payload's SHA-256 (returned), then the payload's chunks; fsynced before it is closed.
    The chunks are written as they come, so a writer holds one part of a snapshot at a
    time, not a copy of all of it: the header goes first for a placeholder digest and is
    written again in place once the payload's is known (`encode_header`'s length does not
    depend on it)."""
    placeholder = header(PLACEHOLDER_SHA256)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(MAGIC + len(placeholder).to_bytes(8, "little") + placeholder)
        digest = hashlib.sha256()
        for chunk in payload:
            digest.update(chunk)
            handle.write(chunk)
        final = header(digest.hexdigest())
        if len(final) != len(placeholder):
            raise AssertionError(f"header of {len(final)} bytes, {len(placeholder)} written")
        handle.seek(PREAMBLE)
        handle.write(final)
        handle.flush()
        os.fsync(handle.fileno())
    return digest.hexdigest()


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
