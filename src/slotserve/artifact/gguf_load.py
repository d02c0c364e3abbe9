"""Load a `Model` from a GGUF file, through the dequantised-weight cache.

The cache is only ever a faster way to the same weights: an entry that fails its checks
(see `weight_cache`) or whose tensors do not fit its `ModelInfo` is rebuilt from the GGUF
with a warning naming the cache file; errors about the GGUF itself name the GGUF.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import track

from slotserve.artifact import weight_cache
from slotserve.artifact.gguf_file import (
    iter_tensors,
    model_info_from_gguf,
    open_gguf,
    read_metadata,
    tensor_shapes,
)
from slotserve.artifact.gguf_reader import GGUFFile
from slotserve.artifact.gguf_tokenizer import TEMPLATE_KEY, tokenizer_from_gguf
from slotserve.errors import ArtifactError
from slotserve.info import ModelInfo
from slotserve.memory import release_mapped_range, trim_heap
from slotserve.model import Model, build_weights
from slotserve.native import NO_KERNELS, Kernels
from slotserve.tokenizer import Tokenizer

log = logging.getLogger("slotserve")


def load_gguf(
    path: Path,
    *,
    use_cache: bool = True,
    progress: bool = True,
    blocks: bool = False,
    kernels: Kernels = NO_KERNELS,
    tokenizer_read: Callable[[], object] | None = None,
) -> Model:
    """Load ``path``; the first load dequantises (with a progress bar) and fills the cache.

    With ``blocks``, the matrices the block kernel multiplies stay the file's blocks
    (`BlockLinear`, read without the cache: there is nothing to dequantise) and the rest is
    dequantised. ``tokenizer_read`` is called once the tokenizer is built from the file's
    metadata, before its tensors are read (`slotserve.load` marks the tokenizer's arena
    there); not on a load from the cache, which reads its weights first."""
    if not path.is_file():
        raise ArtifactError(path, "no such file; pass a path to a .gguf file")
    if blocks:
        info, tokenizer, parts = _read_gguf(path, progress, tokenizer_read, keep_blocks=True)
        weights = build_weights(info, parts, str(path), take=True)
        return Model.from_weights(info, tokenizer, weights, str(path), kernels)
    digest = weight_cache.file_digest(path)
    if use_cache and (model := _load_cached(path, digest, kernels)) is not None:
        return model
    info, tokenizer, tensors = _read_gguf(path, progress, tokenizer_read)
    weights = build_weights(info, tensors, str(path))
    # Written only once the weights were built from it, so a GGUF whose tensors do not
    # fit its metadata never leaves an entry behind.
    if use_cache:
        _try_write_cache(digest, tensors, info, tokenizer)
    return Model.from_weights(info, tokenizer, weights, str(path), kernels)


def _load_cached(path: Path, digest: str, kernels: Kernels) -> Model | None:
    """The model from the cache entry for ``digest``, or None when there is none or it is
    unusable (then a warning names the entry, and the caller rebuilds it)."""
    try:
        cached = weight_cache.read_entry(digest)
        if cached is None:
            return None
        tensors, meta = cached
        entry = weight_cache.entry_path(digest)
        info, tokenizer = _decode_entry_meta(meta, entry, path)
        weights = build_weights(info, tensors, str(entry))
    except ArtifactError as exc:
        log.warning("weight cache entry is unusable, rebuilding it from %s: %s", path, exc)
        return None
    return Model.from_weights(info, tokenizer, weights, str(path), kernels)


def _decode_entry_meta(
    meta: Mapping[str, str], entry: Path, path: Path
) -> tuple[ModelInfo, Tokenizer]:
    """The model info and tokenizer the cache entry of the GGUF at ``path`` holds."""
    for key in ("model_info", "tokenizer"):
        if key not in meta:
            raise ArtifactError(entry, "cache entry lacks this metadata key", key)
    source = f"{path} [{TEMPLATE_KEY}]"  # the entry holds the GGUF's own template
    try:
        return ModelInfo.from_json(meta["model_info"]), Tokenizer.from_json(
            meta["tokenizer"], chat_template_source=source
        )
    except Exception as exc:  # json, dataclass checks and tokenizers (a bare Exception)
        raise ArtifactError(entry, f"cache entry metadata unreadable ({exc})", "metadata") from exc


def _read_gguf(
    path: Path,
    progress: bool,
    tokenizer_read: Callable[[], object] | None,
    *,
    keep_blocks: bool = False,
) -> tuple[ModelInfo, Tokenizer, dict[str, Any]]:
    reader = open_gguf(path)
    meta = read_metadata(reader)
    shapes = tensor_shapes(reader)
    info = model_info_from_gguf(meta, shapes.keys(), path, shapes=shapes)
    tokenizer = tokenizer_from_gguf(meta, str(path))
    # The metadata's Python values (a vocabulary's tokens and merges: some 100,000 strings)
    # go before the tokenizer is measured: the tokenizer's arena is what it keeps.
    del meta
    reader = dataclasses.replace(reader, metadata={})
    if tokenizer_read is not None:
        tokenizer_read()
    tensors: Iterable[tuple[str, Any]] = _released(
        reader, iter_tensors(reader, info, path, keep_blocks=keep_blocks)
    )
    if progress:
        console = Console(file=sys.stderr)
        tensors = track(
            tensors,
            total=len(reader.tensors),
            description=f"{'reading' if keep_blocks else 'dequantising'} {path.name}",
            console=console,
            transient=True,
        )
    return info, tokenizer, dict(tensors)


def _released(reader: GGUFFile, tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``tensors`` (one per tensor of ``reader``, in its order, each copied out of the
    file's map), the map's pages dropped from the resident set once each is copied:
    otherwise the whole file stays resident until the load ends, beside the weights read
    from it, which would raise the load's peak by the file's size. The
    whole span of the tensors' data is released each time, since reading one tensor maps
    its neighbours' pages too (`release_mapped_range`). The copies' freed temporaries (the
    raw rows before packing, rows before un-permuting) go back to the system every
    `TRIM_EVERY` bytes read: ``free`` leaves them resident in the heap's middle, where
    they would add up over the load."""
    span_start = min((t.data.ctypes.data for t in reader.tensors), default=0)
    span_end = max((t.data.ctypes.data + t.data.nbytes for t in reader.tensors), default=0)
    since_trim = 0
    for tensor, item in zip(reader.tensors, tensors, strict=True):
        yield item
        release_mapped_range(span_start, span_end - span_start)
        since_trim += tensor.n_bytes
        if since_trim >= TRIM_EVERY:
            trim_heap()
            since_trim = 0


TRIM_EVERY = 8 * 2**20


def _try_write_cache(
    digest: str, tensors: dict[str, torch.Tensor], info: ModelInfo, tokenizer: Tokenizer
) -> None:
    # The cache only saves time; a read-only or full disk must not stop a load.
    try:
        meta = {"model_info": info.to_json(), "tokenizer": tokenizer.to_json()}
        weight_cache.write_entry(digest, tensors, meta)
    except OSError as exc:
        log.warning("weight cache not written to %s (%s)", weight_cache.entry_path(digest), exc)
