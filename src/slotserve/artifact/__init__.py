"""Reading model files: GGUF (gguf-py + dequantisation), Hugging Face safetensors
directories, slotserve's exported bundles, the bundled default model; the tokenizer and chat
template.

`load(spec)` is the one entry point; it returns a `slotserve.model.Model`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from slotserve.artifact.bundle import is_bundle, read_bundle
from slotserve.artifact.bundled import bundled_gguf_path
from slotserve.artifact.gguf_file import has_block_matrices
from slotserve.artifact.gguf_load import load_gguf
from slotserve.artifact.hf import load_hf_dir
from slotserve.artifact.named import NAMED_MODELS, model_path
from slotserve.artifact.program import open_bundle
from slotserve.errors import ArtifactError
from slotserve.memory import MemoryLedger, Meter, trim_heap
from slotserve.model import Model
from slotserve.model.quantized import with_weights
from slotserve.native import (
    KernelChoice,
    Kernels,
    build_kernels,
    dedicate_cores_to_kernels,
)

WEIGHT_CHOICES = ("auto", "gguf", "fp32", "int8")


def load(
    spec: str | Path,
    *,
    progress: bool = True,
    weights: str = "auto",
    kernels: KernelChoice = "auto",
    bundle_threads: int | None = None,
    ledger: MemoryLedger | None = None,
) -> Model:
    """Load a model: a named one (`NAMED_MODELS`), a ``.gguf`` path, a Hugging Face model
    directory or a bundle directory (`slotserve export`, its checks run here). ``weights``
    is how a GGUF file's or an HF directory's weights are held (`WEIGHT_CHOICES`: ``"gguf"``
    keeps a GGUF file's quantised blocks for the compiled kernel, ``"fp32"`` dequantises,
    ``"int8"`` quantises per channel; ``"auto"``: ``"gguf"`` where it can). ``kernels``:
    ``"auto"`` builds the C kernels for this machine, ``"off"`` runs torch ops only.
    ``bundle_threads`` sizes ExecuTorch's thread pool (default: the manifest's).

    The load only loads: it runs no step. It marks what it holds in ``ledger`` (a new one
    unless given; ``model.ledger`` either way), measured: the process before its first
    model (``runtime``), the tokenizer, the weights (their anonymous growth, with a
    bundle's mapped tables, at least their own bytes), and the load's peak.
    """
    built = build_kernels(kernels)
    weights = weight_format(spec, weights, built)
    ledger = ledger if ledger is not None else MemoryLedger()
    trim_heap()
    meter = ledger.meter(f"load {spec}", peak="load")
    if not ledger.has("runtime"):
        ledger.add("runtime", meter.start.anonymous, "measured", "the process before a model")
    model = _read(spec, weights, built, progress, bundle_threads, lambda: _mark_tokenizer(meter))
    trim_heap()  # the load's freed temporaries leave the resident set
    mapped = model.halves.mapped_weight_bytes  # mapped file pages slotserve keeps
    meter.mark("weights", extra=mapped, at_least=model.weight_bytes)
    meter.close()
    model.ledger = ledger
    return model


def _mark_tokenizer(meter: Meter) -> None:
    """The tokenizer's arena: its growth once the reader's freed temporaries (a GGUF's
    metadata values) have left the resident set, so that it does not hold them (the load's
    peak does)."""
    trim_heap()
    meter.mark("tokenizer")


def _read(
    spec: str | Path,
    weights: str,
    built: Kernels,
    progress: bool,
    bundle_threads: int | None,
    tokenizer_read: Callable[[], object],
) -> Model:
    """The model of ``spec`` with its weights held as ``weights`` (`load`)."""
    if weights == "gguf":
        if built.blocks is None:
            raise ValueError(
                "weights='gguf' needs the block kernel, which is not built (off, or see the "
                "warning above); load with weights='fp32'"
            )
        # Before any torch work of the load: a parallel torch op starts an OpenMP team on
        # this thread that outlives it (see slotserve.native.threads).
        dedicate_cores_to_kernels()
        path = _gguf_path(spec)
        return load_gguf(
            path, progress=progress, blocks=True, kernels=built, tokenizer_read=tokenizer_read
        )
    model = _load(spec, progress, built, bundle_threads, tokenizer_read)
    if weights == "fp32":
        return model
    if model.weights is None:
        raise ValueError(f"weights={weights!r}: a bundle's weights were fixed at export")
    quantised = with_weights(model.weights, weights)
    return Model.from_weights(model.info, model.tokenizer, quantised, model.source, built)


def weight_format(spec: str | Path, weights: str = "auto", kernels: Kernels | None = None) -> str:
    """The format `load` holds ``spec``'s weights in for ``weights`` (which resolves
    ``"auto"``: GGUF blocks where the file has them and ``kernels`` has the block kernel),
    without loading them."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights={weights!r} is not one of {WEIGHT_CHOICES}")
    if weights != "auto":
        return weights
    has_kernel = kernels is not None and kernels.blocks is not None
    return "gguf" if has_kernel and _has_block_matrices(spec) else "fp32"


def _has_block_matrices(spec: str | Path) -> bool:
    path = model_path(spec)
    return path.suffix == ".gguf" and path.is_file() and has_block_matrices(path)


def _gguf_path(spec: str | Path) -> Path:
    path = model_path(spec)
    if path.suffix != ".gguf":
        raise ValueError(f"weights='gguf' keeps a GGUF file's blocks; {str(spec)!r} is not one")
    return path


def _load(
    spec: str | Path,
    progress: bool,
    kernels: Kernels,
    bundle_threads: int | None,
    tokenizer_read: Callable[[], object],
) -> Model:
    path = model_path(spec)
    if is_bundle(path):
        bundle = read_bundle(path)  # its manifest and tokenizer; the program's weights next
        tokenizer_read()
        return open_bundle(bundle, kernels, threads=bundle_threads)
    if path.is_dir():
        return load_hf_dir(path, kernels, tokenizer_read)
    if path.suffix == ".gguf" or path.is_file():
        return load_gguf(path, progress=progress, kernels=kernels, tokenizer_read=tokenizer_read)
    raise ArtifactError(
        path,
        f"no such model; pass one of {tuple(NAMED_MODELS)}, a .gguf file or a Hugging Face "
        "model directory",
    )


__all__ = [
    "NAMED_MODELS",
    "WEIGHT_CHOICES",
    "bundled_gguf_path",
    "is_bundle",
    "load",
    "load_gguf",
    "load_hf_dir",
    "model_path",
    "read_bundle",
]
