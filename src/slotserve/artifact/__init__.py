"""Reading model files: GGUF (gguf-py + dequantisation), Hugging Face safetensors
directories, the bundled default model; the tokenizer and chat template.

`load(spec)` is the one entry point; it returns a `slotserve.model.Model`.
"""

from __future__ import annotations

from pathlib import Path

from slotserve.artifact.bundled import bundled_gguf_path
from slotserve.artifact.gguf_load import load_gguf
from slotserve.artifact.hf import load_hf_dir
from slotserve.artifact.tokenizer import StreamDecoder, Tokenizer
from slotserve.errors import ArtifactError
from slotserve.model import Model


def load(spec: str | Path, *, progress: bool = True) -> Model:
    """Load a model: ``"bundled"``, a ``.gguf`` path, or a Hugging Face model directory."""
    if str(spec) == "bundled":
        return load_gguf(bundled_gguf_path(), progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, progress=progress)
    raise ArtifactError(
        path, "no such model; pass 'bundled', a .gguf file or a Hugging Face model directory"
    )


__all__ = ["StreamDecoder", "Tokenizer", "bundled_gguf_path", "load", "load_gguf", "load_hf_dir"]
