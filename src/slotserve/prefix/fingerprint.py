"""`ModelFingerprint`: what a stored KV snapshot was computed with, besides the KV layout.

A snapshot's bytes depend on the model's weights (the file's SHA-256: a GGUF file, or every
file of a directory), the format they are held in (GGUF blocks by type, fp32, int8, a
bundle's program) and the numerics of the code that computed them: the compiled kernels'
sources, headers, compiler, flags and CPU features (the digest `slotserve.native.build`
names each kernel's library by), whether the attention kernel ran, the halves and torch's
version. Two fingerprints that differ in any field may give different KV for the same
tokens, so the disk tier never serves a file whose fingerprint is not this one.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slotserve.model import Model
from slotserve.model.gguf_linear import BlockEmbedding, BlockLinear, StackedBlocks
from slotserve.model.layers import DenseLinear
from slotserve.model.quantized import Int8Linear
from slotserve.native import build


@dataclass(frozen=True)
class ModelFingerprint:
    """``model_sha256``: the weights' file (or directory) digest; ``weight_format``: how
    they are held (`weight_format`); ``numerics``: a digest of the code that computes with
    them (`numerics_version`)."""

    model_sha256: str
    weight_format: str
    numerics: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def fingerprint(model: Model, attention_kernel: bool) -> ModelFingerprint:
    """``model``'s fingerprint, served with the attention kernel on or off."""
    return ModelFingerprint(
        model_digest(model.source),
        weight_format(model),
        numerics_version(model, attention_kernel),
    )


def model_digest(source: str | Path) -> str:
    """SHA-256 of a model file's bytes; of a directory, of every file's relative path and
    digest (in path order). Memoised per path, size and modification time."""
    path = Path(source)
    if not str(source) or not path.exists():
        raise FileNotFoundError(f"the model's source {str(source)!r} is not a file or directory")
    if path.is_file():
        stat = path.stat()
        return _file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    digest = hashlib.sha256()
    for child in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = child.stat()
        name = child.relative_to(path).as_posix()
        one = _file_digest(str(child.resolve()), stat.st_size, stat.st_mtime_ns)
        digest.update(f"{name}\0{one}\n".encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # the memo's key: a changed file is digested again
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def weight_format(model: Model) -> str:
    """``halves:storage``, the storage of every weight matrix: GGUF block types
    (``Q4_1``, a stack ``Q5_0+Q8_0``), ``dense-float32``, ``int8``; a bundle's program
    (``program``: its files' digest says the rest)."""
    weights = model.weights
    if weights is None:
        return f"{model.halves.kind}:program"
    kinds = {_storage(weights.embed), _storage(weights.lm_head)}
    for layer in weights.layers:
        kinds.update(_storage(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return f"{model.halves.kind}:{','.join(sorted(kinds))}"


def _storage(matrix: Any) -> str:
    if isinstance(matrix, BlockEmbedding):
        return matrix.table.kind
    if isinstance(matrix, BlockLinear):
        return matrix.kind
    if isinstance(matrix, StackedBlocks):
        return "+".join(part.kind for part in matrix.parts)
    if isinstance(matrix, Int8Linear):
        return "int8"
    if isinstance(matrix, DenseLinear):
        return f"dense-{str(matrix.weight.dtype).removeprefix('torch.')}"
    if isinstance(matrix, torch.Tensor):
        return f"dense-{str(matrix.dtype).removeprefix('torch.')}"
    return type(matrix).__name__


def numerics_version(model: Model, attention_kernel: bool) -> str:
    """A digest of what computes the KV: each compiled kernel in use named by its library
    (`slotserve.native.build.library_path`: a digest of its sources, the headers, the
    compiler, its flags and the CPU's features), ``off`` for one not in use; the halves;
    torch's version."""
    lines = [f"halves={model.halves.kind}", f"torch={torch.__version__}"]
    for name in ("attention", "blocks"):
        in_use = getattr(model.kernels, name) is not None
        if name == "attention":
            in_use = in_use and attention_kernel
        lines.append(f"{name}={_kernel_version(name) if in_use else 'off'}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def _kernel_version(name: str) -> str:
    try:
        return build.library_path(name).name
    except OSError:  # no compiler now (the kernel was built before): the sources alone
        digest = hashlib.sha256(build.source(name).read_bytes())
        for header in sorted(build.CSRC.glob("*.h")):
            digest.update(header.read_bytes())
        digest.update(" ".join(build.FLAGS).encode() + os.uname().machine.encode())
        return f"{name}-src-{digest.hexdigest()[:16]}"
