"""How the serving commands open a model: ``--executor``, ``--threads`` and ``--fallback``.

A bundle (`slotserve export`) always runs on the ExecuTorch executor. ``--executor xnnpack``
on a Q4_0/Q4_1 GGUF exports it once as an ``8da4w`` XNNPACK bundle in the weight cache
directory (keyed by the file's SHA-256 and the step size), so the second start is fast.
``--fallback MODEL`` serves MODEL, loudly, when the bundle is refused (a schema this runtime
does not read, a missing or mismatched file, a delegate it does not have).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from slotserve.executor import Executor, executor_for
from slotserve.model import Model
from slotserve.model.gguf_linear import dedicate_cores_to_kernels
from slotserve.model.layers import DenseLinear

EXECUTORS = ("torch", "xnnpack")
log = logging.getLogger("slotserve")


def add_executor_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="torch",
        help="for a .gguf/HF model: torch runs the eager model; xnnpack exports the model "
        "once (cached) as an 8da4w XNNPACK bundle and runs that (a bundle --model always "
        "runs on ExecuTorch)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="ExecuTorch thread-pool size for a bundle (default: its manifest's load option)",
    )
    parser.add_argument(
        "--fallback",
        default=None,
        metavar="MODEL",
        help="serve MODEL (e.g. 'bundled') if the bundle is refused by the runtime's checks",
    )


@contextlib.contextmanager
def kernel_threads(spec: str, weights: str) -> Iterator[None]:
    """Around a command that loads ``spec`` with ``weights`` and runs it: where that is the
    GGUF block kernels, torch's own ops run on one thread meanwhile (see
    `dedicate_cores_to_kernels`; entered before loading, which starts torch's threads)."""
    from slotserve.artifact import weight_format

    if weight_format(spec, weights) != "gguf":
        yield
        return
    saved = torch.get_num_threads()
    dedicate_cores_to_kernels()
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def bundle_path(gguf: Path, max_tokens: int) -> Path:
    """Where `--executor xnnpack` keeps the bundle of ``gguf`` for steps of ``max_tokens``."""
    from slotserve.artifact.weight_cache import file_digest
    from slotserve.paths import cache_dir

    return cache_dir() / f"bundle-{file_digest(gguf)[:32]}-8da4w-t{max_tokens}"


def open_model(args: argparse.Namespace, max_tokens: int) -> tuple[str, Model, Executor]:
    """The model ``args.model`` names (or, refused, ``args.fallback``'s), the executor that
    runs it, and which of the two it is (see the module doc)."""
    from slotserve.artifact import load
    from slotserve.errors import ArtifactError

    try:
        model = load(args.model, weights=args.weights)
        if args.executor == "xnnpack" and model.weights is not None:
            model = load(exported_bundle(model, max_tokens))
        return args.model, model, executor_for(model, threads=args.threads)
    except ArtifactError as refusal:
        if args.fallback is None:
            raise
        log.error("REFUSED %s: %s", args.model, refusal)
        log.error("FALLING BACK to --fallback %s: clients get that model instead", args.fallback)
        model = load(args.fallback, weights=args.weights)
        return args.fallback, model, executor_for(model)


def exported_bundle(model: Model, max_tokens: int) -> Path:
    """The cached 8da4w bundle of the GGUF ``model``, exported on first use with progress."""
    from rich.console import Console

    from slotserve.export import ExportOptions, export_bundle

    gguf = Path(model.source)
    if gguf.suffix != ".gguf":
        raise ValueError(
            f"--executor xnnpack needs a Q4_0/Q4_1 GGUF model, not {model.source!r}; export "
            "other models with `slotserve export` and serve the bundle"
        )
    path = bundle_path(gguf, max_tokens)
    if path.exists():
        return path
    if not isinstance(model.weights.lm_head if model.weights else None, DenseLinear):
        from slotserve.artifact import load

        model = load(gguf, weights="fp32")  # export reads the fp32 weights
    console = Console(stderr=True)
    options = ExportOptions(quant="8da4w", max_tokens=max_tokens)
    with console.status(f"exporting {gguf.name} to XNNPACK (once; cached as {path})") as bar:
        export_bundle(model, path, options, progress=bar.update)
    log.info("exported bundle: %s", path)
    return path
