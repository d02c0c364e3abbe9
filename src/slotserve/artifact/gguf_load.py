"""Load a `Model` from a GGUF file, through the dequantised-weight cache."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track

from slotserve.artifact import weight_cache
from slotserve.artifact.gguf_file import (
    iter_tensors,
    model_info_from_gguf,
    open_gguf,
    read_metadata,
)
from slotserve.artifact.gguf_tokenizer import tokenizer_from_gguf
from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo
from slotserve.model import Model, build_weights
from slotserve.tokenizer import Tokenizer


def load_gguf(path: Path, *, use_cache: bool = True, progress: bool = True) -> Model:
    """Load ``path``; the first load dequantises (with a progress bar) and fills the cache."""
    if not path.is_file():
        raise ArtifactError(path, "no such file; pass a path to a .gguf file")
    digest = weight_cache.file_digest(path)
    cached = weight_cache.read_entry(digest) if use_cache else None
    if cached is not None:
        tensors, meta = cached
        info = ModelInfo.from_json(meta["model_info"])
        tokenizer = Tokenizer.from_json(meta["tokenizer"])
    else:
        info, tokenizer, tensors = _read_gguf(path, progress)
        if use_cache:
            _try_write_cache(digest, tensors, info, tokenizer)
    weights = build_weights(info, tensors, str(path))
    return Model(info, tokenizer, weights, source=str(path))


def _read_gguf(path: Path, progress: bool) -> tuple[ModelInfo, Tokenizer, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    meta = read_metadata(reader)
    info = model_info_from_gguf(meta, {t.name for t in reader.tensors}, path)
    tokenizer = tokenizer_from_gguf(meta, str(path))
    tensors: Iterable[tuple[str, torch.Tensor]] = iter_tensors(reader, info, path)
    if progress:
        console = Console(file=sys.stderr)
        tensors = track(
            tensors,
            total=len(reader.tensors),
            description=f"dequantising {path.name}",
            console=console,
            transient=True,
        )
    return info, tokenizer, dict(tensors)


def _try_write_cache(
    digest: str, tensors: dict[str, torch.Tensor], info: ModelInfo, tokenizer: Tokenizer
) -> None:
    # The cache only saves time; a read-only or full disk must not stop a load.
    try:
        meta = {"model_info": info.to_json(), "tokenizer": tokenizer.to_json()}
        weight_cache.write_entry(digest, tensors, meta)
    except OSError as exc:
        print(f"slotserve: weight cache not written ({exc})", file=sys.stderr)
