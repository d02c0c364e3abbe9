"""Where slotserve keeps what it builds once per machine: weight caches, the compiled
kernels (`slotserve.native.build`), llama.cpp binaries."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """``$SLOTSERVE_CACHE_DIR`` or the platform's user cache directory."""
    override = os.environ.get("SLOTSERVE_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("slotserve"))
