"""Where slotserve keeps what it builds once per machine (weight caches, cached bundles,
compiled kernels, llama.cpp binaries), and how it builds its C kernels.

A kernel is a C source of the package, compiled with the system C compiler and loaded with
ctypes. ``-march=native`` compiles for this CPU, so the library's file name carries a
digest of the source, the compiler and its flags, and the CPU's feature list; it lives in
``cache_dir()/kernels``. The build writes a temporary file and renames it, so processes
that build at once never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """``$SLOTSERVE_CACHE_DIR`` or the platform's user cache directory."""
    override = os.environ.get("SLOTSERVE_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("slotserve"))


def load_library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """``source`` built with ``flags`` (on first use) and loaded. Raises `OSError` where
    there is no compiler, `subprocess.CalledProcessError` where the build fails."""
    return ctypes.CDLL(str(built_library(source, flags)))


def built_library(source: Path, flags: tuple[str, ...]) -> Path:
    """The shared library of ``source`` for these flags and this CPU, compiled if missing."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    digest = hashlib.sha256(source.read_bytes())
    digest.update(" ".join((compiler, *flags)).encode())
    digest.update(_cpu_features().encode())
    target = cache_dir() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".tmp{os.getpid()}")
        command = [compiler, *flags, "-o", str(partial), str(source), "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        partial.replace(target)  # atomic: a concurrent build never sees half a file
    return target


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return ""


def process_cores() -> int:
    """The cores this process may run on (the kernels' OpenMP threads, one per core)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
