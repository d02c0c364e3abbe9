"""``--executor``: which backend runs a step, and the lowered program it needs.

``torch`` is the eager model. ``xnnpack`` runs the projections of a Q4_0/Q4_1 GGUF model
from an ExecuTorch program, lowered once per file and step size and kept in the weight cache
directory (keyed by the file's SHA-256), so the second start is fast.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from slotserve.model import Model

if TYPE_CHECKING:
    from slotserve.executor.xnnpack import XnnpackExecutor

EXECUTORS = ("torch", "xnnpack")
log = logging.getLogger("slotserve")


def add_executor_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="torch",
        help="torch: the eager model; xnnpack: a Q4 GGUF's projections lowered to ExecuTorch "
        "(4-bit weights kept exactly, int8 activations; lowered once, then cached)",
    )


def program_path(gguf: Path, max_tokens: int) -> Path:
    """Where the lowered program of ``gguf`` for steps of up to ``max_tokens`` is cached."""
    from slotserve.artifact.weight_cache import cache_dir, file_digest

    return cache_dir() / f"xnnpack-{file_digest(gguf)[:32]}-t{max_tokens}.pte"


def executor_for(name: str, model: Model, max_tokens: int) -> XnnpackExecutor | None:
    """The executor ``name`` for ``model`` (None: the engine's default, eager torch). Give
    the engine ``executor.model``: it no longer holds the projections the program runs."""
    if name == "torch":
        return None
    from slotserve.executor.xnnpack import XnnpackExecutor

    gguf = Path(model.source)
    if gguf.suffix != ".gguf":
        raise ValueError(
            f"--executor xnnpack needs a Q4_0/Q4_1 GGUF model, not {model.source!r}; "
            "use --executor torch"
        )
    path = program_path(gguf, max_tokens)
    if not path.exists():
        export_program(model, gguf, path, max_tokens)
    return XnnpackExecutor(model, path, max_tokens)


def export_program(model: Model, gguf: Path, path: Path, max_tokens: int) -> None:
    """Lower ``model`` to ``path``, showing progress (minutes on a 2-core CPU)."""
    from rich.console import Console

    from slotserve.export import export_layer_program

    console = Console(stderr=True)
    with console.status(f"lowering {gguf.name} to XNNPACK (once; cached as {path.name})") as bar:
        export_layer_program(model, gguf, path, max_tokens=max_tokens, progress=bar.update)
    log.info("lowered program: %s", path)
