"""Readings of the process's memory, and the few calls that change it.

`read_process` reads what the kernel counts for a process (Linux ``/proc/PID/status``):
its resident set, split into anonymous pages (the heap, torch's tensors, the KV pool: dirty
memory only this process holds, what a phone's low-memory killer and iOS's footprint count)
and file-backed pages (libraries' code, mapped model files: clean, the kernel's to drop and
read again), and the resident set's peak. The memory plan is kept in anonymous bytes
(`slotserve.memory.ledger`); the resident set is reported beside it. Nothing here drops
another library's pages: `release_mapped_range` releases only a file map slotserve itself
made and has finished reading.
"""

from __future__ import annotations

import ctypes
import mmap
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Reading:
    """One reading of a process's memory, in bytes: ``resident`` (VmRSS) is ``anonymous``
    (RssAnon) + ``file`` (RssFile) + ``shared`` (RssShmem); ``peak`` is the resident set's
    peak (VmHWM) since the process started or since `reset_peak`."""

    resident: int
    anonymous: int
    file: int
    shared: int
    peak: int

    def to_dict(self) -> dict[str, int]:
        return {
            "resident_bytes": self.resident,
            "anonymous_bytes": self.anonymous,
            "file_bytes": self.file,
            "shared_bytes": self.shared,
            "peak_resident_bytes": self.peak,
        }


_STATUS_FIELDS = {
    "VmRSS:": "resident",
    "RssAnon:": "anonymous",
    "RssFile:": "file",
    "RssShmem:": "shared",
    "VmHWM:": "peak",
}


def read_process(pid: int | None = None) -> Reading:
    """This process's memory, or process ``pid``'s (Linux ``/proc/PID/status``). Without
    /proc: this process's peak resident set (getrusage) in every field, 0 for another
    process. The kernel keeps these counters per thread and folds them in lazily, so a
    reading may lag the truth by a few pages a thread."""
    values = dict.fromkeys(_STATUS_FIELDS.values(), 0)
    try:
        with open(f"/proc/{pid or 'self'}/status") as status:
            for line in status:
                field = _STATUS_FIELDS.get(line.split(":", 1)[0] + ":")
                if field is not None:
                    values[field] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if pid is None else 0
        return Reading(peak, peak, 0, 0, peak)
    return Reading(**values)


def rss_bytes(pid: int | None = None) -> int:
    """The resident set of this process, or of process ``pid`` (`read_process`)."""
    return read_process(pid).resident


def anonymous_bytes(pid: int | None = None) -> int:
    """The anonymous (dirty) resident bytes of this process, or of process ``pid``: what
    the memory plan counts (`read_process`)."""
    return read_process(pid).anonymous


def reset_peak() -> bool:
    """Start the resident set's peak (`Reading.peak`) again from the current resident set
    (Linux: ``5`` written to /proc/self/clear_refs); False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def anonymous_peak_since(start: Reading) -> int:
    """A bound on the anonymous bytes' peak since ``start``, a reading taken right after
    `reset_peak`: the resident peak less the file pages resident at ``start``. The kernel
    keeps no anonymous peak; the file pages resident then (the libraries' code) stay
    resident, so the rest of the peak was anonymous or file pages mapped since, which a
    budget that counts slotserve's own mapped files must hold too."""
    now = read_process()
    return max(now.peak - start.file - start.shared, now.anonymous, start.anonymous)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). A model's load frees its temporaries (dequantised copies, file buffers) in
    the middle of the heap, where ``free`` alone keeps them resident."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library's, already loaded
    if trim is not None:
        trim(0)


class IdleTrim:
    """`trim_heap` once a pause in a loop's work has lasted ``after_s``, once a pause:
    malloc keeps the pages of a step's freed activations, and the next step faults back in
    the pages it uses, so the trim waits for a pause rather than running after each step.
    The loop calls `busy` when it steps and `idle` when it has nothing to step; nothing is
    trimmed before its first step. One thread's (the loop's) alone."""

    def __init__(self, after_s: float, trim: Callable[[], None] = trim_heap) -> None:
        self.after_s, self.trim = after_s, trim
        self._idle_since: float | None = None
        self._trimmed = True

    def busy(self) -> None:
        self._idle_since, self._trimmed = None, False

    def idle(self) -> None:
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._trimmed and now - self._idle_since >= self.after_s:
            self.trim()
            self._trimmed = True


# glibc's mallopt parameter for the most arenas the threads may use (malloc.h).
_M_ARENA_MAX = -8


def one_malloc_arena() -> None:
    """Have every thread this process starts from now on allocate from the C heap's main
    arena (glibc's ``mallopt(M_ARENA_MAX, 1)``; nothing elsewhere). glibc gives a thread
    that contends for the heap an arena of its own, and `trim_heap` could not return the
    pages a step's freed activations left in the engine thread's. The threads that
    allocate take turns on the GIL, so
    they seldom wait on one arena's lock; the C kernels allocate nothing."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 1)


def written_bytes(address: int, nbytes: int) -> int | None:
    """The bytes of ``[address, address + nbytes)`` on pages this process has written and
    holds: present, and mapped by this process alone (Linux's ``/proc/self/pagemap``), so
    the kernel's shared zero page, which a read of an untouched anonymous page maps, is not
    counted. None where the page map cannot be read."""
    page = mmap.PAGESIZE
    first, end = address // page, (address + nbytes + page - 1) // page
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = pagemap.read((end - first) * 8)
    except OSError:
        return None
    import numpy as np

    flags = np.frombuffer(entries, dtype="<u8")
    held = int(((flags >> np.uint64(63)) & (flags >> np.uint64(56)) & np.uint64(1)).sum())
    return min(held * page, nbytes)  # bit 63: present; bit 56: exclusively mapped


def release_mapped_range(address: int, nbytes: int) -> None:
    """Drop the pages of ``nbytes`` of slotserve's own map of a model file, from ``address``
    on, from this process's resident set (Linux ``madvise(MADV_DONTNEED)``; nothing
    elsewhere), once the load has copied them out. The data stays readable: a later read
    faults it in again from the page cache. Without this the whole file stays resident
    until the map closes, beside the weights copied out of it. A read of one tensor maps
    more of the file than the tensor (the kernel maps a fault's whole folio and its
    neighbours), so a load releases the span of every tensor read so far, not each
    tensor's own bytes. This is the only madvise slotserve makes: it never touches another
    library's mappings."""
    if not nbytes:
        return
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    _dont_need(start, address + nbytes - start)


def _dont_need(start: int, length: int) -> bool:
    """``madvise(start, length, MADV_DONTNEED)`` (``start`` page-aligned); False where the
    system has no such call or refused it."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None:
        return False
    madvise = ctypes.CDLL(None).madvise  # the C library's, already loaded: no search
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return bool(madvise(start, length, advice) == 0)
