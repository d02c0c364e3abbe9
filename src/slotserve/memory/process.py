"""Measured memory: the process's resident set size, and what a model's load added to it;
byte counts as people write them (`parse_bytes`, `format_bytes`)."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import resource
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}


def parse_bytes(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"1.5 GiB"``, ``"512MB"`` → bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte count must be >= 0, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"cannot parse {value!r} as a size; write e.g. 1073741824, '1GiB', '1.5GiB' or '512MB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def rss_bytes(pid: int | None = None) -> int:
    """Current resident set size of this process, or of process ``pid`` (Linux /proc);
    without /proc, this process's peak from getrusage (0 for another process)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes() if pid is None else 0


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident set size of this process, or of process ``pid``, so far or since
    `reset_peak_rss` (Linux's VmHWM); without /proc, this process's peak from getrusage
    (0 for another process)."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if pid is None else 0


def reset_peak_rss() -> bool:
    """Start `peak_rss_bytes` again from the current resident set (Linux: ``5`` written to
    /proc/self/clear_refs); False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). A model's load frees its temporaries (dequantised copies, file buffers) in
    the middle of the heap, where ``free`` alone keeps them resident: about 57 MiB on the
    bundled model."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library's, already loaded
    if trim is not None:
        trim(0)


# glibc's mallopt parameter for the most arenas the threads may use (malloc.h).
_M_ARENA_MAX = -8


def one_malloc_arena() -> None:
    """Have every thread this process starts from now on allocate from the C heap's main
    arena (glibc's ``mallopt(M_ARENA_MAX, 1)``; nothing elsewhere). glibc gives a thread
    that contends for the heap an arena of its own, and `trim_heap` could not return the
    pages a step's freed activations left in the engine thread's: measured on a server of
    the bundled model at 4 x 2,048, 15 MiB at ready, and 546 against 531 MiB after four
    1,500-token prompts and a trim. The threads that allocate take turns on the GIL, so
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
    """Drop the pages of the ``nbytes`` of a file-backed memory map from ``address`` on from
    this process's resident set (Linux ``madvise(MADV_DONTNEED)``; nothing elsewhere). The
    data stays readable: a later read faults it in again from the page cache. A model's load
    reads each tensor out of the file's map once, so without this the whole file stays
    resident until the map closes, beside the weights copied out of it. A read of one
    tensor maps more of the file than the tensor (the kernel maps a fault's whole folio and
    its neighbours: 1.5 MiB for a 540 KiB tensor), so a load that releases each tensor's own
    bytes alone keeps those of its neighbours, already read, resident (52 of the bundled
    model's 94 MiB); it releases the span of all of them."""
    if not nbytes:
        return
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    _dont_need(start, address + nbytes - start)


def release_code_pages() -> int:
    """Drop the pages of every library's code this process has mapped from its resident
    set (Linux ``madvise(MADV_DONTNEED)`` on each executable file mapping; nothing
    elsewhere) and return how many bytes were resident there. The code stays runnable: an
    instruction on a dropped page faults it in again from the page cache, where the pages
    stay (clean, the kernel's to reclaim). What this takes is the code only the imports ran:
    libtorch's static initialisers register its thousands of operators from all over its
    text, and left 46 MiB of libtorch_cpu's code resident after ``import torch``; four
    prompts on the bundled model fault back 16 of the 71 MiB dropped, and no step ran
    measurably slower. A mapping with pages of its own (a text relocation, a debugger's
    breakpoint) is left alone: dropping those pages would lose the writes."""
    try:
        mappings = _code_mappings()
    except OSError:
        return 0
    return sum(resident for start, end, resident in mappings if _dont_need(start, end - start))


def code_resident_bytes() -> int:
    """How much of the libraries' code (the mappings `release_code_pages` drops) is
    resident now; 0 where /proc cannot say."""
    try:
        return sum(resident for _, _, resident in _code_mappings())
    except OSError:
        return 0


def _dont_need(start: int, length: int) -> bool:
    """``madvise(start, length, MADV_DONTNEED)`` (``start`` page-aligned); False where the
    system has no such call or refused it."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None:
        return False
    madvise = ctypes.CDLL(None).madvise  # the C library's, already loaded: no search
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return bool(madvise(start, length, advice) == 0)


def _code_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each executable file mapping that holds no page of
    its own (``Private_Dirty`` and ``Anonymous`` 0), from /proc/self/smaps."""
    mappings: list[dict[str, int]] = []
    current: dict[str, int] | None = None  # the code mapping whose fields follow
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = None
                if len(fields) >= 6 and fields[1] == "r-xp" and fields[5].startswith("/"):
                    first, last = (int(x, 16) for x in fields[0].split("-"))
                    current = {"start": first, "end": last}
                    mappings.append(current)
            elif current is not None and fields[0] in ("Rss:", "Private_Dirty:", "Anonymous:"):
                current[fields[0]] = int(fields[1]) * 1024
    return [
        (m["start"], m["end"], m["Rss:"])
        for m in mappings
        if m.get("Rss:") and not m.get("Private_Dirty:") and not m.get("Anonymous:")
    ]


@dataclass(frozen=True)
class LoadMemory:
    """What loading one model did to the process, measured: ``runtime_bytes`` its resident set
    just before the load (the interpreter, torch, the libraries and whatever else the
    process already held), ``loaded_bytes`` just after. ``load_code_bytes`` is the library
    code the load ran and left resident (`code_resident_bytes`): runtime, not the model's.
    How much of it one instruction maps depends on how the library's file entered the page
    cache: in a fresh install (files just written by pip, their page-cache folios mapped
    whole) the bundled model's load left 62.2 MiB of code, against 18.4 MiB in an older one.
    ``tokenizer_bytes`` is what reading the model's metadata and building its tokenizer
    added before the weights were read, less code (`TokenizerMark`; 0 where the loader reads
    the weights first, which then count it): a GGUF file's vocabulary is its metadata,
    22.6-23.5 MiB resident for SmolLM2's 49,152 tokens and merges, which is not weights.
    The growth is the rest: the weights as they are resident (with whatever the load kept:
    packed copies, freed pages the allocator did not give back), not their file size.
    ``peak_bytes`` is the resident set's peak during the load (its transient copies; 0: not
    measured, where the system cannot reset the peak), which a budget must hold too.
    ``first_step_bytes`` is what the first step left resident (one token, run by the load):
    one-time state that belongs to the runtime arena (`runtime_arena_bytes`).
    ``method_bytes`` is what a bundle's program methods keep resident after the largest
    step they take (run by the load after the first): the planned arenas that step writes
    and the delegates' scratch for its rows; 0 for a model whose halves are not a
    program."""

    runtime_bytes: int
    loaded_bytes: int
    peak_bytes: int = 0
    first_step_bytes: int = 0
    method_bytes: int = 0
    tokenizer_bytes: int = 0
    load_code_bytes: int = 0

    def __post_init__(self) -> None:
        counts = (
            self.runtime_bytes,
            self.loaded_bytes,
            self.peak_bytes,
            self.first_step_bytes,
            self.method_bytes,
            self.tokenizer_bytes,
            self.load_code_bytes,
        )
        if min(counts) < 0:
            raise ValueError(f"{self} holds a negative byte count")

    @property
    def runtime_arena_bytes(self) -> int:
        """The runtime arena: the resident set before the model, the library code its load
        ran, and the first step's one-time state."""
        return self.runtime_bytes + self.load_code_bytes + self.first_step_bytes

    @property
    def growth_bytes(self) -> int:
        """The resident growth across the load beyond the tokenizer's and the code's: the
        weights as resident (0 if the process shrank)."""
        grown = self.loaded_bytes - self.runtime_bytes - self.tokenizer_bytes
        return max(grown - self.load_code_bytes, 0)


class TokenizerMark:
    """Called by a loader once it has read a model's metadata and built its tokenizer, and
    before it reads the weights: keeps the resident set then (``rss_bytes``; None until
    called) and the library code in it (``code_bytes``), which `slotserve.load` turns into
    `LoadMemory.tokenizer_bytes`."""

    def __init__(self) -> None:
        self.rss_bytes: int | None = None
        self.code_bytes = 0

    def __call__(self) -> None:
        self.rss_bytes, self.code_bytes = rss_bytes(), code_resident_bytes()
