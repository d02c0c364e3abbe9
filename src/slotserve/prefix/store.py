"""`PrefixStore`: the prefix cache's disk tier, so conversations survive a restart.

The memory tier offers the store the snapshots likely to be used again (`offer`: a
conversation's latest turn, a prompt that was hit; `slotserve.prefix.cache`), and a writer
thread writes each as one file; a step never waits for it: the queue is bounded and an
offer that finds it full is skipped and counted (``queue_full``). A device's flash is a
budget too: a snapshot under ``min_tokens`` tokens is not written (``too_short``: cheaper
to compute again), and the writer spends at most ``write_rate`` bytes a second on average
(a token bucket holding `WRITE_BURST_S` seconds' worth; a file the bucket cannot pay for
is skipped, ``rate_limited``); ``bytes_written`` counts what it wrote. The writer copies the
snapshot's cells out of the pool a part at a time, checksumming and writing each before
it copies the next (it never holds the whole snapshot, which the memory plan does not
count), while the snapshot lives (a `WriteTicket` the cache cancels when it drops the
snapshot; a file whose copy raced the drop is thrown away and counted: ``superseded`` when
a snapshot that extends it took its place and is offered in turn, ``dropped`` when it was
evicted first). A lookup that misses in memory but hits on disk
(`lookup`, then `restore`) reads the file's cells back into the request's own fresh
reservation (inside its prefill span, never under the engine lock), and checks the payload's
checksum as it reads: a restore that fails any check commits nothing. Files are evicted
least recently used first (a hit touches its file's mtime, so the order survives a
restart) to keep the bytes on disk within the budget; a file whose tokens a newer one
extends, and which serves no restore the newer one does not, is deleted.

A file is an artifact with a contract: its layout, header and checks are
`slotserve.prefix.store_file`'s. It is written to a temporary name, fsynced, renamed into
place and its directory fsynced, so a crash mid-write leaves no torn file (only a temporary
one, deleted at the next start). At start the store indexes the directory from headers
alone, so the first request after a restart can hit.

Every file that fails a check is skipped, counted by reason (`REFUSAL_REASONS`) and never
served: ``schema`` (not a store file, or another schema), ``model`` (other weights or weight
format), ``numerics`` (other kernels, flags, CPU or torch), ``layout`` (another KV layout,
dtype, block size or geometry), ``checksum`` (a header or payload that does not match its
digest: truncated, flipped, appended to), ``retention`` (a retention state this pool cannot
hold, or, at lookup, a ring that wrapped past the prefix: the memory tier's rule). Damaged
files (``checksum``) are deleted; files of another model, numerics, layout or schema are
left for whoever wrote them and do not count against this store's budget.

A directory that cannot be created or written is a `PrefixStoreError` at start (the server
exits with it), not a store that silently keeps nothing. Writes that fail later (a full
disk: ``disk_full``; any other ``io_error``) are skipped and counted; nothing crashes.

Threads: the engine calls `offer` and `lookup` under its lock, and `restore` without it
(on its restore thread, into the request's own cells); the writer thread takes only the
store's own lock, and never while it copies, hashes or writes. The store's lock ranks after
the engine's (`slotserve.locks`): nothing is taken while it is held, and nothing that could
run engine code (a finalizer takes no lock) can block on it.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from slotserve.errors import SlotserveError
from slotserve.kv.pool import KVPool
from slotserve.locks import PREFIX_STORE, WRITE_TICKET, OrderedLock
from slotserve.model import Model
from slotserve.prefix.fingerprint import fingerprint
from slotserve.prefix.store_file import (
    MAGIC,
    PLACEHOLDER_SHA256,
    PREAMBLE,
    REFUSAL_REASONS,
    SUFFIX,
    TMP_PREFIX,
    Refused,
    StoreEntry,
    StoreIdentity,
    bytes_of,
    encode_header,
    fsync_directory,
    open_regular,
    part_nbytes,
    payload_parts,
    read_header,
    write_file,
)
from slotserve.prefix.trie import TokenTrie

# With the format's names a store's users need too (`slotserve.prefix.store_file`).
__all__ = [
    "MAGIC",
    "REFUSAL_REASONS",
    "SKIP_REASONS",
    "SUFFIX",
    "PrefixStore",
    "PrefixStoreError",
    "StoreCounters",
    "StoreEntry",
    "StoreIdentity",
    "StoreMatch",
    "StoreReport",
    "StoreSurvey",
    "WriteTicket",
    "check_directory",
    "open_store",
    "survey_store",
]
log = logging.getLogger("slotserve")

SKIP_REASONS = (
    "queue_full", "too_big", "too_short", "rate_limited", "superseded", "dropped",
    "disk_full", "io_error",
)  # fmt: skip
DEFAULT_QUEUE = 8
DEFAULT_FLUSH_S = 30.0
WRITE_BURST_S = 8.0  # the write budget's bucket: this many seconds of ``write_rate``

Retains = Callable[[int, int], bool]  # (high_water, upto) -> whether every ring holds it
Loader = Callable[[Iterable[torch.Tensor]], None]


class PrefixStoreError(SlotserveError):
    """The store's directory cannot be used (missing and not creatable, or not writable)."""


@dataclass(frozen=True)
class StoreMatch:
    """A stored snapshot that can restore the first ``usable`` positions of a prompt."""

    entry: StoreEntry
    usable: int


@dataclass
class StoreCounters:
    """Monotone counters of one store (``refused``, ``skipped``: by reason)."""

    indexed: int = 0
    written: int = 0
    bytes_written: int = 0
    hits: int = 0
    tokens_restored: int = 0
    evictions: int = 0
    covered: int = 0
    torn_removed: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class StoreReport:
    """A consistent copy of the store's figures (`PrefixStore.report`)."""

    directory: str
    budget_bytes: int
    bytes: int
    files: int
    index_seconds: float
    queued: int  # offered, not yet written or skipped (the one being written included)
    counters: StoreCounters


TicketState = Literal["queued", "reading", "read", "cancelled"]


class WriteTicket:
    """One offered snapshot. The cache `cancel`s it when it drops the snapshot (``why``:
    ``superseded`` by a snapshot that extends it, else ``dropped``: evicted or consumed);
    the writer trusts a copy only if the ticket was not cancelled before the copy ended."""

    def __init__(
        self, tokens: tuple[int, ...], high_water: int, read: Callable[[], Iterable[torch.Tensor]]
    ) -> None:
        self.tokens, self.high_water, self.read = tokens, high_water, read
        self.state: TicketState = "queued"
        self.why = ""
        self.lock = OrderedLock("write ticket", WRITE_TICKET)

    def cancel(self, why: str = "dropped") -> None:
        assert why in SKIP_REASONS, why
        with self.lock:
            if self.state in ("queued", "reading"):
                self.state, self.why = "cancelled", why

    def _begin(self) -> bool:
        with self.lock:
            if self.state == "cancelled":
                return False
            self.state = "reading"
            return True

    def _end(self) -> bool:
        with self.lock:
            if self.state == "cancelled":
                return False
            self.state = "read"
            return True


class PrefixStore:
    """Snapshots on disk in ``directory``, at most ``budget_bytes``. See the module doc.
    ``retains`` is the pool's retention rule for a snapshot it does not hold
    (`KVPool.retains_from`); ``writer=False`` starts no thread (tests drive `drain`).
    ``min_tokens`` and ``write_rate`` (bytes a second; None: unlimited) bound the writes;
    ``clock`` times the write budget."""

    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        identity: StoreIdentity,
        retains: Retains,
        *,
        queue_size: int = DEFAULT_QUEUE,
        writer: bool = True,
        min_tokens: int = 1,
        write_rate: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"prefix store budget_bytes={budget_bytes} must be > 0")
        if queue_size < 1:
            raise ValueError(f"prefix store queue_size={queue_size} must be >= 1")
        self.directory = Path(directory)
        self.budget_bytes, self.identity, self.retains = budget_bytes, identity, retains
        self.stats = StoreCounters()
        self.min_tokens = min_tokens
        self._budget = None if write_rate is None else WriteBudget(write_rate, clock)
        self._lock = OrderedLock("prefix store", PREFIX_STORE)
        self._entries: OrderedDict[int, StoreEntry] = OrderedDict()  # least recent first
        self._by_name: dict[str, int] = {}
        self._trie = TokenTrie()
        self._bytes = 0
        self._keys = itertools.count()
        self._tmp_names = itertools.count()
        self._queue: queue.Queue[WriteTicket | None] = queue.Queue(queue_size)
        self._warned: set[str] = set()
        self.closed = False
        self._prepare_directory()
        began = time.perf_counter()
        self._index()
        self.index_seconds = time.perf_counter() - began
        self._thread: threading.Thread | None = None
        if writer:
            self._thread = threading.Thread(target=self._run, name="slotserve-store", daemon=True)
            self._thread.start()

    # -- start -----------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        where = self.directory
        check_directory(where)
        for leftover in where.glob(f"{TMP_PREFIX}*"):
            # Torn writes of a process that died mid-write: never renamed, never served.
            if _writer_alive(leftover):
                continue  # another live store's write in progress
            try:
                leftover.unlink()
                self.stats.torn_removed += 1
            except OSError:
                pass

    def _index(self) -> None:
        """Read every file's header; list the usable ones, least recently used first."""
        found = read_index(self.directory, self.identity, self._keys)
        for path, refusal in found.refused:
            self.stats.refused[refusal.reason] += 1
            if refusal.reason == "checksum":
                _unlink(path)
            log.info("prefix store: %s skipped (%s)", path.name, refusal)
        for entry in found.entries:
            self._insert(entry)
        self.stats.indexed = len(self._entries)
        while self._bytes > self.budget_bytes and self._entries:  # a smaller budget now
            _unlink(self.directory / self._evict_oldest().name)
        if found.foreign_files:
            log.warning(
                "prefix store %s: %d files (%.1f MiB) are not for this model, numerics, KV "
                "layout or schema: never served, left in place",
                self.directory, found.foreign_files, found.foreign_bytes / 2**20,
            )  # fmt: skip

    # -- reads -----------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the indexed files."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def entries(self) -> list[StoreEntry]:
        """The indexed files, least recently used first (a copy)."""
        with self._lock:
            return list(self._entries.values())

    def report(self) -> StoreReport:
        with self._lock:
            stats = self.stats
            counters = replace(
                stats, refused=Counter(stats.refused), skipped=Counter(stats.skipped)
            )
            return StoreReport(
                str(self.directory), self.budget_bytes, self._bytes, len(self._entries),
                self.index_seconds, self._queue.unfinished_tasks, counters,
            )  # fmt: skip

    def lookup(self, tokens: Sequence[int], better_than: int = 0) -> StoreMatch | None:
        """The stored snapshot that restores the most of ``tokens`` (more than
        ``better_than``, at most ``len(tokens) - 1``) whose rings still hold it, the most
        recently used of equals; None otherwise. When the deepest token-equal ones are
        refused by the retention rule (a ring that wrapped past the prefix) it counts
        ``retention`` once, and a shorter one may still serve."""
        limit = len(tokens) - 1
        with self._lock:
            recency = {key: rank for rank, key in enumerate(self._entries)}
            refused_at = 0  # the most a token-equal snapshot the rule refused would restore
            found: StoreMatch | None = None
            for depth, keys in self._trie.reach(tokens):
                usable = min(depth, limit)
                if usable <= better_than:
                    break
                for key in sorted(keys, key=recency.__getitem__, reverse=True):
                    entry = self._entries[key]
                    if self.retains(entry.high_water, usable):
                        found = StoreMatch(entry, usable)
                        break
                    refused_at = max(refused_at, usable)
                if found is not None:
                    break
            if refused_at > (found.usable if found is not None else 0):
                self.stats.refused["retention"] += 1
            return found

    def restore(
        self, match: StoreMatch, load: Loader, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Read ``match``'s payload, checking its SHA-256 as it goes, into ``load``
        (`KVPool.load_payload`, which commits only once every part was read and checked).
        True when restored; False when the file is gone (evicted meanwhile) or is no longer
        a regular file, fails its checksum (counted, deleted) or cannot be read, or when
        ``stop`` (asked before each part is read: a cancel) says so, ``load`` having
        committed nothing."""
        entry = match.entry
        path = self.directory / entry.name
        try:
            handle = open_regular(path)
        except (OSError, Refused):
            self._forget(entry)
            return False
        try:
            with handle:
                handle.seek(entry.payload_at)
                load(_until(stop, payload_parts(handle, entry)))
        except _Stopped:
            return False
        except Refused as refusal:
            log.warning("prefix store: %s refused (%s); computed instead", entry.name, refusal)
            with self._lock:
                self.stats.refused[refusal.reason] += 1
            self._forget(entry)
            _unlink(path)
            return False
        except OSError as exc:  # a read that fails (EIO): computed instead, the file kept
            log.warning("prefix store: reading %s failed (%s); computed instead", entry.name, exc)
            return False
        with self._lock:
            if entry.key in self._entries:
                self._entries.move_to_end(entry.key)
            self.stats.hits += 1
            self.stats.tokens_restored += match.usable
        _touch(path)
        return True

    # -- writes ----------------------------------------------------------------------

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether a file of exactly ``tokens`` is indexed (marks it used)."""
        name = self.identity.file_name(tokens)
        with self._lock:
            key = self._by_name.get(name)
            if key is None:
                return False
            self._entries.move_to_end(key)
        return True

    def offer(
        self, tokens: Sequence[int], high_water: int, read: Callable[[], Iterable[torch.Tensor]]
    ) -> WriteTicket | None:
        """Queue ``tokens``' snapshot (written up to ``high_water``; ``read`` copies its
        payload) for the writer; None, counted, when it is shorter than ``min_tokens``
        (``too_short``) or the queue is full (``queue_full``). Never waits."""
        if len(tokens) < self.min_tokens:
            with self._lock:
                self.stats.skipped["too_short"] += 1
            return None
        ticket = WriteTicket(tuple(tokens), high_water, read)
        try:
            self._queue.put_nowait(ticket)
        except queue.Full:
            with self._lock:
                self.stats.skipped["queue_full"] += 1
            return None
        return ticket

    def flush(self, timeout: float = DEFAULT_FLUSH_S) -> bool:
        """Wait until every queued snapshot is written or skipped; False on timeout. Without
        a writer thread, write them here."""
        if self._thread is None:
            self.drain()
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def drain(self) -> None:
        """Write every queued snapshot on this thread (a store without a writer)."""
        while True:
            try:
                ticket = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                if ticket is not None:
                    self._write(ticket)
            finally:
                self._queue.task_done()

    def close(self, timeout: float = DEFAULT_FLUSH_S) -> None:
        """Write what is queued (within ``timeout``), then stop the writer."""
        self.closed = True
        if self._thread is None:
            self.drain()
            return
        self.flush(timeout)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        _lower_priority()
        while True:
            ticket = self._queue.get()
            try:
                if ticket is None:
                    return
                self._write(ticket)
            except Exception:  # a bug in a write must not stop the writer
                log.exception("prefix store: writing a snapshot failed")
            finally:
                self._queue.task_done()

    def _skip(self, reason: str, detail: str = "") -> None:
        with self._lock:
            self.stats.skipped[reason] += 1
        if detail and reason not in self._warned:
            self._warned.add(reason)
            where = self.directory
            log.warning("prefix store %s: snapshot not written (%s): %s", where, reason, detail)

    def _write(self, ticket: WriteTicket) -> None:
        if not ticket._begin():
            self._skip(ticket.why)
            return
        tokens = ticket.tokens
        expected = self.identity.part_specs(len(tokens))
        nbytes = sum(part_nbytes(spec) for spec in expected)
        written_unix = time.time()

        def header(sha256: str) -> bytes:
            return encode_header(
                self.identity, tokens, ticket.high_water, expected, nbytes, sha256, written_unix
            )

        def payload() -> Iterator[memoryview]:
            # One part copied out of the pool at a time (`KVPool.read_payload`), checked
            # against its spec, written, then freed: the writer holds no copy of the whole
            # snapshot, which the memory plan does not count.
            parts = ticket.read()
            for spec, part in zip(expected, parts, strict=True):
                actual = [spec[0], str(part.dtype), list(part.shape)]
                assert actual == spec, f"payload part {actual} != {spec}"
                yield bytes_of(part)

        size = PREAMBLE + len(header(PLACEHOLDER_SHA256)) + nbytes
        name = self.identity.file_name(tokens)
        if size > self.budget_bytes:
            ticket._end()
            self._skip("too_big")
            return
        if self._budget is not None and not self._budget.spend(size):
            ticket._end()
            self._skip("rate_limited")
            return
        for victim in self._make_room(size, name):
            _unlink(self.directory / victim)
        final = self.directory / name
        temporary = self.directory / f"{TMP_PREFIX}{name}-{os.getpid()}-{next(self._tmp_names)}"
        try:
            digest = write_file(temporary, header, payload())
        except OSError as exc:
            ticket._end()
            _unlink(temporary)
            reason = "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io_error"
            self._skip(reason, str(exc))
            return
        if not ticket._end():  # dropped while copying: its blocks may have been reused
            _unlink(temporary)
            self._skip(ticket.why)
            return
        try:
            os.replace(temporary, final)
            fsync_directory(self.directory)
        except OSError as exc:
            _unlink(temporary)
            self._skip("io_error", str(exc))
            return
        entry = StoreEntry(
            next(self._keys), name, tokens, ticket.high_water, size,
            size - nbytes, expected, digest,
        )  # fmt: skip
        with self._lock:
            if (same := self._by_name.get(name)) is not None:
                self._remove(self._entries[same])  # its file was just replaced
            self._insert(entry)
            covered = self._covered_by(entry)
            for old in covered:
                self._remove(old)
            self.stats.written += 1
            self.stats.bytes_written += size
            self.stats.covered += len(covered)
        for old in covered:
            _unlink(self.directory / old.name)

    def _make_room(self, size: int, name: str) -> list[str]:
        """Unlist least recently used files until a file of ``size`` bytes named ``name``
        fits the budget (one of that name now, which it replaces, is not counted and not
        evicted); the names of the files to delete."""
        victims = []
        with self._lock:
            same = self._by_name.get(name)
            replaced = self._entries[same].nbytes if same is not None else 0
            while self._bytes - replaced + size > self.budget_bytes:
                oldest = next((k for k in self._entries if k != same), None)
                if oldest is None:
                    break
                self._entries.move_to_end(oldest, last=False)
                victims.append(self._evict_oldest().name)
        return victims

    def _covered_by(self, entry: StoreEntry) -> list[StoreEntry]:
        """Listed files whose tokens ``entry``'s extend and whose every restore it serves
        too (with rings, only where its own rings still hold what theirs did)."""
        n = len(entry.tokens)
        covered = []
        for other in self._entries.values():
            m = len(other.tokens)
            if other is entry or m > n or entry.tokens[:m] != other.tokens:
                continue
            if all(
                self.retains(entry.high_water, upto) or not self.retains(other.high_water, upto)
                for upto in range(1, m + 1)
            ):
                covered.append(other)
        return covered

    # -- index (under the lock) ------------------------------------------------------

    def _insert(self, entry: StoreEntry) -> None:
        self._entries[entry.key] = entry
        self._by_name[entry.name] = entry.key
        self._trie.insert(entry.key, entry.tokens)
        self._bytes += entry.nbytes

    def _remove(self, entry: StoreEntry) -> None:
        del self._entries[entry.key]
        del self._by_name[entry.name]
        self._trie.remove(entry.key, entry.tokens)
        self._bytes -= entry.nbytes

    def _evict_oldest(self) -> StoreEntry:
        entry = next(iter(self._entries.values()))
        self._remove(entry)
        self.stats.evictions += 1
        return entry

    def _forget(self, entry: StoreEntry) -> None:
        with self._lock:
            if self._entries.get(entry.key) is entry:
                self._remove(entry)

    # -- checks ----------------------------------------------------------------------

    def check_integrity(self, *, idle: bool = True) -> None:
        """The index is exactly the files on disk it names, with their sizes, within the
        budget; the trie and the name map match it; with ``idle`` (nothing queued or being
        written), no temporary file is left. Once closed, the index alone (another store
        may own the directory now)."""
        with self._lock:  # files leave the index before they leave the disk
            entries = dict(self._entries)
            assert self._bytes == sum(e.nbytes for e in entries.values()), "bytes drifted"
            assert self._bytes <= self.budget_bytes, "over the disk budget"
            assert self._by_name == {e.name: k for k, e in entries.items()}, "names drifted"
            assert all(e.key == k for k, e in entries.items()), "keys drifted"
            self._trie.check_integrity({k: e.tokens for k, e in entries.items()})
            if self.closed:
                return  # the directory is no longer this store's to check
            on_disk = {p.name: p.lstat().st_size for p in self.directory.glob(f"*{SUFFIX}")}
            for entry in entries.values():
                assert on_disk.get(entry.name) == entry.nbytes, f"{entry.name} missing or resized"
        if idle:
            assert not self._queue.unfinished_tasks, "writes still queued"
            assert not list(self.directory.glob(f"{TMP_PREFIX}*")), "a temporary file is left"


def check_directory(directory: str | Path) -> None:
    """Create ``directory`` if need be and check that a file can be written, synced and
    removed there; `PrefixStoreError` naming it otherwise (the CLI checks before loading
    the model, the store again when it opens)."""
    where = Path(directory)
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f"{TMP_PREFIX}probe-{os.getpid()}-0"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"slotserve")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise PrefixStoreError(
            f"prefix store {str(where)!r} is not a directory this process can write "
            f"({exc.strerror or exc}); pass a writable directory to --prefix-store "
            "(prefix_store=...), or leave it off"
        ) from None


def _writer_alive(temporary: Path) -> bool:
    """Whether the temporary file ``temporary`` (``.tmp-NAME-PID-N``) belongs to another
    process that still runs (its write may be in progress)."""
    parts = temporary.name.split("-")
    try:
        pid = int(parts[-2])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


WRITER_NICE = 10


def _lower_priority() -> None:
    """Give the writer thread (only it: Linux schedules threads one by one) nice
    `WRITER_NICE`, about a tenth of a core's share against the engine's threads when both
    want one. Not ``SCHED_IDLE``: a thread of that class preempted while it holds the GIL
    may not run again while every core is busy, and the engine thread would wait for the
    GIL as long."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(WRITER_NICE, os.getpriority(os.PRIO_PROCESS, tid)))


class WriteBudget:
    """A token bucket of bytes: ``rate`` a second, holding at most `WRITE_BURST_S`
    seconds' worth (full at start). A write is paid for while the bucket holds anything,
    so a file larger than the bucket is written when it is full, the debt paid off before
    the next one."""

    def __init__(self, rate: int, clock: Callable[[], float]) -> None:
        if rate <= 0:
            raise ValueError(f"prefix store write_rate={rate} must be > 0 bytes a second")
        self.rate, self.clock = rate, clock
        self.capacity = rate * WRITE_BURST_S
        self.level, self._at = self.capacity, clock()

    def spend(self, nbytes: int) -> bool:
        """Pay for a write of ``nbytes`` if the bucket holds anything now; False if empty."""
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now
        if self.level <= 0:
            return False
        self.level -= nbytes
        return True


class _Stopped(Exception):
    """A restore stopped by its caller between two parts (`PrefixStore.restore`)."""


def _until(
    stop: Callable[[], bool] | None, parts: Iterator[torch.Tensor]
) -> Iterator[torch.Tensor]:
    """``parts``, asking ``stop`` before each is read; `_Stopped` once it says so."""
    while stop is None or not stop():
        part = next(parts, None)
        if part is None:
            return
        yield part
    raise _Stopped


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


@dataclass(frozen=True)
class IndexRead:
    """What `read_index` found in a store's directory: the usable files' entries, least
    recently used first; each refused file with its refusal; the files of another model,
    numerics, layout or schema (refused, not damaged: left in place), and their bytes."""

    entries: list[StoreEntry]
    refused: list[tuple[Path, Refused]]
    foreign_files: int
    foreign_bytes: int


def read_index(
    directory: Path, identity: StoreIdentity, keys: Iterator[int] | None = None
) -> IndexRead:
    """Read the header of every file in ``directory`` against ``identity``; changes nothing
    on disk (`PrefixStore` deletes the damaged ones and evicts past its budget)."""
    keys = keys if keys is not None else itertools.count()
    found: list[tuple[float, StoreEntry]] = []
    refused: list[tuple[Path, Refused]] = []
    foreign = [0, 0]
    for path in directory.glob(f"*{SUFFIX}"):
        try:
            entry = read_header(path, identity, next(keys))
        except Refused as refusal:
            refused.append((path, refusal))
            if refusal.reason not in ("checksum", "not_a_file"):
                foreign[0] += 1
                foreign[1] += _size(path)
            continue
        except OSError as exc:
            log.warning("prefix store: %s unreadable (%s); skipped", path.name, exc)
            continue
        found.append((_mtime(path), entry))
    entries = [entry for _mtime_s, entry in sorted(found, key=lambda item: item[0])]
    return IndexRead(entries, refused, foreign[0], foreign[1])


@dataclass(frozen=True)
class StoreSurvey:
    """What a store in ``directory`` would index at start (`survey_store`): its usable
    files and their bytes, the files it would refuse by reason, and the time the read took."""

    directory: str
    files: int
    bytes: int
    refused: dict[str, int]
    index_seconds: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def store_identity(model: Model, pool: KVPool, *, attention_kernel: bool) -> StoreIdentity:
    """What the files of a store for ``model`` over ``pool`` must have been computed with."""
    return StoreIdentity(
        fingerprint(model, attention_kernel), pool.kv_identity(), tuple(pool.payload_parts())
    )


def survey_store(
    directory: str | Path, model: Model, pool: KVPool, *, attention_kernel: bool
) -> StoreSurvey:
    """What `open_store` would index in ``directory`` now, from the headers alone, changing
    nothing there (`slotserve plan` shows it); a directory that does not exist holds none."""
    where = Path(directory)
    identity = store_identity(model, pool, attention_kernel=attention_kernel)
    began = time.perf_counter()  # the index alone, as `PrefixStore.index_seconds`
    found = read_index(where, identity) if where.is_dir() else IndexRead([], [], 0, 0)
    refused = Counter(refusal.reason for _path, refusal in found.refused)
    return StoreSurvey(
        str(where), len(found.entries), sum(e.nbytes for e in found.entries), dict(refused),
        time.perf_counter() - began,
    )  # fmt: skip


def open_store(
    directory: str | Path,
    budget_bytes: int,
    model: Model,
    pool: KVPool,
    *,
    attention_kernel: bool,
    writer: bool = True,
    min_tokens: int = 1,
    write_rate: int | None = None,
) -> PrefixStore:
    """The store in ``directory`` for ``model`` served over ``pool`` (with the attention
    kernel on or off), indexed, its figures logged; `PrefixStoreError` if the directory
    cannot be written."""
    identity = store_identity(model, pool, attention_kernel=attention_kernel)
    store = PrefixStore(
        directory, budget_bytes, identity, pool.retains_from, writer=writer,
        min_tokens=min_tokens, write_rate=write_rate,
    )  # fmt: skip
    report = store.report()
    refused = dict(report.counters.refused)
    log.info(
        "prefix store %s: %d snapshots, %.1f of %.1f MiB, indexed in %.1f ms%s",
        report.directory, report.files, report.bytes / 2**20, report.budget_bytes / 2**20,
        report.index_seconds * 1e3, f"; skipped {refused}" if refused else "",
    )  # fmt: skip
    return store
