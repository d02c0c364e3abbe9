"""The process's memory: readings (`process`), the ledger of arenas the plan is checked
against (`ledger`), and byte counts as people write them (`units`). A leaf: it imports
nothing of slotserve but its errors."""

from slotserve.memory.ledger import (
    Arena,
    Budget,
    MemoryLedger,
    MemoryMap,
    Meter,
    budget_problems,
)
from slotserve.memory.process import (
    IdleTrim,
    Reading,
    anonymous_bytes,
    anonymous_peak_since,
    one_malloc_arena,
    read_process,
    release_mapped_range,
    reset_peak,
    rss_bytes,
    trim_heap,
    written_bytes,
)
from slotserve.memory.units import format_bytes, parse_bytes

__all__ = [
    "Arena",
    "Budget",
    "IdleTrim",
    "MemoryLedger",
    "MemoryMap",
    "Meter",
    "Reading",
    "anonymous_bytes",
    "anonymous_peak_since",
    "budget_problems",
    "format_bytes",
    "one_malloc_arena",
    "parse_bytes",
    "read_process",
    "release_mapped_range",
    "reset_peak",
    "rss_bytes",
    "trim_heap",
    "written_bytes",
]
