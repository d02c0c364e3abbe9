"""Reading model files: GGUF (gguf-py + dequantisation), Hugging Face safetensors
directories, slotserve's exported bundles, the bundled default model; the tokenizer and chat
template.

`load(spec)` is the one entry point; it returns a `slotserve.model.Model`.
"""

from __future__ import annotations

from pathlib import Path

from slotserve.artifact.bundle import is_bundle, read_bundle
from slotserve.artifact.bundled import bundled_gguf_path
from slotserve.artifact.gguf_file import has_block_matrices
from slotserve.artifact.gguf_load import load_gguf
from slotserve.artifact.hf import load_hf_dir
from slotserve.errors import ArtifactError
from slotserve.model import Model
from slotserve.model.gguf_linear import gguf_kernel
from slotserve.model.quantized import with_weights

WEIGHT_CHOICES = ("auto", "gguf", "fp32", "int8")


def load(spec: str | Path, *, progress: bool = True, weights: str = "auto") -> Model:
    """Load a model: ``"bundled"``, a ``.gguf`` path, a Hugging Face model directory, or a
    bundle directory (`slotserve export`). A bundle's model holds no weights: its checks run
    here (schema, files), and `slotserve.Engine` runs it on the ExecuTorch executor.

    ``weights`` is how a GGUF file's or an HF directory's weights are held:
    ``"gguf"`` keeps a GGUF file's Q4_0/Q4_1/Q8_0 matrices as its blocks, multiplied by a
    compiled kernel with llama.cpp's arithmetic (`slotserve.model.gguf_linear`: the file's
    size resident, and the fastest decode); ``"fp32"`` dequantises everything;
    ``"int8"`` quantises fp32 projections per channel (`slotserve.model.quantized`).
    ``"auto"`` (the default) is ``"gguf"`` for a GGUF file with such matrices where the
    kernel builds, else ``"fp32"``.
    """
    weights = weight_format(spec, weights)
    if weights == "gguf":
        return load_gguf(_gguf_path(spec), progress=progress, blocks=True)
    model = _load(spec, progress)
    if weights == "fp32":
        return model
    if model.weights is None:
        raise ValueError(f"weights={weights!r}: a bundle's weights were fixed at export")
    return Model(model.info, model.tokenizer, with_weights(model.weights, weights), model.source)


def weight_format(spec: str | Path, weights: str = "auto") -> str:
    """The format `load` holds ``spec``'s weights in for ``weights`` (which resolves
    ``"auto"``), without loading them."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHT_CHOICES}")
    return _automatic_format(spec) if weights == "auto" else weights


def _automatic_format(spec: str | Path) -> str:
    path = bundled_gguf_path() if str(spec) == "bundled" else Path(spec).expanduser()
    if path.suffix != ".gguf" or not path.is_file() or not has_block_matrices(path):
        return "fp32"
    return "gguf" if gguf_kernel() is not None else "fp32"


def _gguf_path(spec: str | Path) -> Path:
    path = bundled_gguf_path() if str(spec) == "bundled" else Path(spec).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(f"weights='gguf' keeps a GGUF file's blocks; {str(spec)!r} is not one")
    return path


def _load(spec: str | Path, progress: bool) -> Model:
    if str(spec) == "bundled":
        return load_gguf(bundled_gguf_path(), progress=progress)
    path = Path(spec).expanduser()
    if is_bundle(path):
        return read_bundle(path).model()
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, progress=progress)
    raise ArtifactError(
        path, "no such model; pass 'bundled', a .gguf file or a Hugging Face model directory"
    )


__all__ = [
    "WEIGHT_CHOICES",
    "bundled_gguf_path",
    "is_bundle",
    "load",
    "load_gguf",
    "load_hf_dir",
    "read_bundle",
]
