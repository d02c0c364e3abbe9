"""Building the C kernels: one compiler, one set of flags, one cache, one log line.

A kernel is ``csrc/NAME.c`` (with the headers in ``csrc``), compiled with the system
C compiler and loaded with ctypes. ``-march=native`` compiles for this CPU, so the library's
file name carries a digest of the sources, the compiler, its flags and the CPU's feature
list; it lives in ``cache_dir()/kernels``. A build writes a temporary file and renames it,
so processes that build at once never load half a file. Building happens only when asked
(`slotserve.native.build_kernels`, called by `slotserve.load` and ``slotserve
build-kernels``), never as a side effect of a constructor or a query.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from slotserve.paths import cache_dir

CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=off: the operations are the ones written. Left to itself the compiler fuses a
# multiply and an add in one inlined copy of a loop and not in another (a group of 4 rows
# against a row alone), and a row's result would depend on its batch.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

_log = logging.getLogger("slotserve")


def compiler() -> str:
    """``$CC``, else ``cc`` or ``gcc`` on PATH; `OSError` where there is none."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise OSError("no C compiler (cc or gcc) on PATH; install one, or set CC")
    return found


def source(name: str) -> Path:
    return CSRC / f"{name}.c"


def library_path(name: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the library of kernel ``name`` built with ``flags`` for this CPU lives."""
    digest = hashlib.sha256(source(name).read_bytes())
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join((compiler(), *flags)).encode())
    digest.update(_cpu_features().encode())
    return cache_dir() / "kernels" / f"{name}-{digest.hexdigest()[:16]}.so"


def build(name: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of kernel ``name``, compiled (and logged) if missing. Raises
    `OSError` without a compiler, `subprocess.CalledProcessError` when the build fails."""
    target = library_path(name, flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".tmp{os.getpid()}")
    command = [compiler(), *flags, f"-I{CSRC}", "-o", str(partial), str(source(name)), "-lm"]
    _log.info("building kernel %s (once for this CPU): %s", name, " ".join(command))
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=180)
    partial.replace(target)  # atomic: a concurrent build never sees half a file
    return target


def load(name: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Kernel ``name`` built with ``flags`` (see `build`) and loaded."""
    return ctypes.CDLL(str(build(name, flags)))


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return ""
