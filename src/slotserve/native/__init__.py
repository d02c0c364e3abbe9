"""Every C kernel of slotserve: one build (`build`: flags, cache, explicit and logged), the
shared ``csrc/common.h``, one thin binding per kernel taking a ``ctypes.Structure`` mirrored
in C (`attention`, `blocks`), and one thread policy (`threads`).

`build_kernels` is the one place kernels are built and the one switch for them: ``"auto"``
builds what this machine can (a kernel that cannot build is None, with the reason logged
once), ``"off"`` uses none (every step on torch ops). `slotserve.load` calls it; the engine
takes the attention kernel from the model it serves (``EngineConfig.kernels``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from slotserve.native import build
from slotserve.native.attention import AttentionKernel
from slotserve.native.blocks import BlockKernel
from slotserve.native.threads import (
    dedicate_cores_to_kernels,
    on_own_thread,
    process_cores,
    release_team,
    torch_on_cores,
)

KernelChoice = Literal["auto", "off"]
KERNEL_CHOICES: tuple[KernelChoice, ...] = ("auto", "off")

K = TypeVar("K")

_log = logging.getLogger("slotserve")


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels a model runs with; None where one is off or could not build."""

    attention: AttentionKernel | None = None
    blocks: BlockKernel | None = None

    def describe(self) -> str:
        names = [name for name in ("attention", "blocks") if getattr(self, name) is not None]
        return ", ".join(names) or "none"


NO_KERNELS = Kernels()


def build_kernels(choice: KernelChoice = "auto") -> Kernels:
    """The kernels for ``choice`` (see the module doc); built once per process (and once
    per machine: the libraries are cached on disk)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={choice!r} is not one of {KERNEL_CHOICES}")
    return NO_KERNELS if choice == "off" else _built()


def require_block_kernel() -> BlockKernel:
    """The block kernel `build_kernels` built; never builds (a product is no place for a
    compiler run). A clear error where it was not built or could not be."""
    if _built.cache_info().currsize == 0:
        raise RuntimeError(
            "GGUF block weights need the compiled kernel: call slotserve.native."
            "build_kernels() first (slotserve.load does), or load with weights='fp32'"
        )
    kernel = _built().blocks
    if kernel is None:
        raise RuntimeError(
            "GGUF block weights need the compiled kernel, which could not be built (see the "
            "warning above); install a C compiler (cc) or load with weights='fp32'"
        )
    return kernel


@functools.cache
def _built() -> Kernels:
    threads = process_cores()
    attention = _try("attention", lambda lib: AttentionKernel(lib, threads))
    blocks = _try("blocks", lambda lib: BlockKernel(lib, threads))
    return Kernels(attention, blocks)


def _try(name: str, bind: Callable[[ctypes.CDLL], K]) -> K | None:
    try:
        return bind(build.load(name))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        _log.warning("kernel %s unavailable (%s); torch ops run instead", name, detail)
        return None


__all__ = [
    "KERNEL_CHOICES",
    "NO_KERNELS",
    "AttentionKernel",
    "BlockKernel",
    "KernelChoice",
    "Kernels",
    "build_kernels",
    "dedicate_cores_to_kernels",
    "on_own_thread",
    "process_cores",
    "release_team",
    "require_block_kernel",
    "torch_on_cores",
]
