"""How the serving commands open a model: ``--threads`` and ``--fallback``.

A ``.gguf`` file or an HF directory runs on its loaded weights (eager halves, or the block
kernels); a bundle directory (`slotserve export`) runs its program on the ExecuTorch runtime.
``--fallback MODEL`` serves MODEL, loudly, when the bundle is refused (a schema this runtime
does not read, a missing or mismatched file, a delegate it does not have).
"""

from __future__ import annotations

import argparse
import logging

from slotserve.executor import Executor, executor_for
from slotserve.model import Model
from slotserve.native import KernelChoice

log = logging.getLogger("slotserve")


def add_executor_args(parser: argparse.ArgumentParser) -> None:
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


def open_model(args: argparse.Namespace) -> tuple[str, Model, Executor]:
    """The model ``args.model`` names (or, refused, ``args.fallback``'s), the executor that
    runs it, and which of the two it is (see the module doc)."""
    from slotserve.artifact import load
    from slotserve.errors import ArtifactError

    kernels: KernelChoice = "off" if getattr(args, "kernels", None) == "off" else "auto"
    try:
        model = load(args.model, weights=args.weights, kernels=kernels, bundle_threads=args.threads)
        return args.model, model, executor_for(model)
    except ArtifactError as refusal:
        if args.fallback is None:
            raise
        log.error("REFUSED %s: %s", args.model, refusal)
        log.error("FALLING BACK to --fallback %s: clients get that model instead", args.fallback)
        model = load(args.fallback, weights=args.weights, kernels=kernels)
        return args.fallback, model, executor_for(model)
