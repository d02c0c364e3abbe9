"""`SessionKV`: what the pool knows of one session."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SessionKV:
    """A session's binding in the pool.

    ``slot`` is its row in flat/ring storage, ``table`` its block table in cell storage
    (block ``table[i]`` holds positions ``i*block_size .. (i+1)*block_size - 1``).
    ``capacity`` positions are reserved; ``length`` are committed (written).
    ``high_water`` is the longest the session has been: ring cells below
    ``high_water - window`` have been overwritten, even after a rewind.
    """

    slot: int
    capacity: int
    length: int = 0
    table: list[int] = field(default_factory=list)
    high_water: int = 0
