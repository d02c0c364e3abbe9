"""The ``slotserve`` command line: one module per command, shared flags in `flags`.

Each command module has ``register(commands)`` (its argparse sub-parser) and ``run(args)``
(its exit status). Commands import what they need when they run, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from slotserve.cli import bench, build_kernels, chat, export, generate, inspect, plan, serve
from slotserve.errors import SlotserveError
from slotserve.memory import one_malloc_arena

COMMANDS = {
    "generate": generate,
    "chat": chat,
    "inspect": inspect,
    "plan": plan,
    "serve": serve,
    "bench": bench,
    "export": export,
    "build-kernels": build_kernels,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    one_malloc_arena()  # before the engine's and the server's threads start
    logging.basicConfig(level=logging.WARNING, format="slotserve: %(message)s")
    logging.getLogger("slotserve").setLevel(logging.INFO)  # progress lines of our own
    try:
        status: int = COMMANDS[args.command].run(args)
        return status
    except (SlotserveError, ValueError) as exc:
        print(f"slotserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The ``slotserve`` command as a process: `main`, then exit without the interpreter's
    last collections walking every object the run made (torch's and the model's: about a
    second after a server has stopped). Nothing of the run is collected after this, so
    only a process that exits calls it, never a caller of `main`."""
    status = main()
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    run()
