"""Measured memory: the process's resident set size."""

from __future__ import annotations

import os
import resource


def rss_bytes(pid: int | None = None) -> int:
    """Current resident set size of this process, or of process ``pid`` (Linux /proc);
    without /proc, this process's peak from getrusage (0 for another process)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes() if pid is None else 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
