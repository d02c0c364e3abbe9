"""Building the C kernels: one compiler, one set of flags, one cache, one log line.

A kernel is ``csrc/NAME.c`` (with the headers in ``csrc``), compiled with the system
C compiler and loaded with ctypes. ``-march=native`` compiles for this CPU, so the library's
file name carries a digest of the sources, the compiler, its flags and the CPU's feature
list; it lives in ``cache_dir()/kernels``. A build writes a temporary file and renames it,
so processes that build at once never load half a file. Building happens only when asked
(`slotserve.native.build_kernels`, called by `slotserve.load` and ``slotserve
build-kernels``), never as a side effect of a constructor or a query.

The same sources build for another machine too (`build_for`): a `Target` names its C
compiler and ``-march`` level, as `AARCH64_LEVELS` name Debian's AArch64 cross compiler
at the levels ``csrc`` has paths for. Those libraries are not this machine's to load; they
are for a device, or for the emulated kernel tests (``tests/native/test_aarch64.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from slotserve.paths import cache_dir

CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=off: the operations are the ones written. Left to itself the compiler fuses a
# multiply and an add in one inlined copy of a loop and not in another (a group of 4 rows
# against a row alone), and a row's result would depend on its batch.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")

_log = logging.getLogger("slotserve")


@dataclass(frozen=True)
class Target:
    """A machine to build the kernels for: its C compiler (a command on PATH) and the
    ``-march`` level they are compiled for in place of ``native``."""

    compiler: str
    march: str

    def __post_init__(self) -> None:
        if not self.compiler or not self.march or " " in self.march:
            raise ValueError(
                f"Target(compiler={self.compiler!r}, march={self.march!r}): both must be "
                "non-empty, and march one -march value"
            )

    @property
    def flags(self) -> tuple[str, ...]:
        """`FLAGS` for this target's level."""
        return tuple(f"-march={self.march}" if f == "-march=native" else f for f in FLAGS)


AARCH64_COMPILER = "aarch64-linux-gnu-gcc"  # Debian's gcc-aarch64-linux-gnu
# AArch64 levels, each the lowest -march that enables its path in csrc (docs/KERNELS.md):
# plain C (NEON is in every ARMv8-A, but only the compiler's own vectorising uses it), the
# dot-product path (SDOT: ARMv8.2-A's FEAT_DotProd) and the int8 matrix path (SMMLA:
# FEAT_I8MM, with SDOT for a lone row).
AARCH64_LEVELS = {
    "plain": Target(AARCH64_COMPILER, "armv8-a"),
    "dotprod": Target(AARCH64_COMPILER, "armv8.2-a+dotprod"),
    "i8mm": Target(AARCH64_COMPILER, "armv8.2-a+dotprod+i8mm"),
}


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
    if not target.exists():
        _compile(compiler(), flags, CSRC, name, target, "once for this CPU")
    return target


def _compile(
    cc: str, flags: tuple[str, ...], csrc: Path, name: str, library: Path, purpose: str
) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".tmp{os.getpid()}")
    command = [cc, *flags, f"-I{csrc}", "-o", str(partial), str(csrc / f"{name}.c"), "-lm"]
    _log.info("building kernel %s (%s): %s", name, purpose, " ".join(command))
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=180)
    partial.replace(library)  # atomic: a concurrent build never sees half a file


def build_for(
    target: Target, name: str, *, csrc: Path = CSRC, directory: Path | None = None
) -> Path:
    """The shared library of kernel ``name`` from ``csrc`` (default: these sources) built
    for ``target``, compiled (and logged) if missing, in ``directory`` (default: the cache
    directory's ``kernels/<march>``). Its file name carries a digest of the sources, the
    compiler and the flags (not this CPU's features: the level is named). Raises as
    `build` does."""
    digest = hashlib.sha256((csrc / f"{name}.c").read_bytes())
    for header in sorted(csrc.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join((target.compiler, *target.flags)).encode())
    folder = directory or cache_dir() / "kernels" / target.march.replace("+", "-")
    library = folder / f"{name}-{digest.hexdigest()[:16]}.so"
    if not library.exists():
        _compile(target.compiler, target.flags, csrc, name, library, f"for {target.march}")
    return library


def load(name: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Kernel ``name`` built with ``flags`` (see `build`) and loaded."""
    return ctypes.CDLL(str(build(name, flags)))


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` compiles for them): x86's ``flags`` line,
    AArch64's ``Features``."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line for line in handle if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
