"""``slotserve export MODEL OUT.pte``: lower a Q4_0/Q4_1 GGUF model's projections to an
ExecuTorch (XNNPACK) program, as ``--executor xnnpack`` does on first use."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser("export", help="lower a Q4 GGUF model to an XNNPACK program")
    parser.add_argument("model", help="'bundled' or a Q4_0/Q4_1 .gguf file")
    parser.add_argument("out", type=Path, help="the .pte file to write")
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="largest step (match --max-batch-tokens)"
    )


def run(args: argparse.Namespace) -> int:
    from slotserve.artifact import load
    from slotserve.cli.executors import export_program

    model = load(args.model)
    export_program(model, Path(model.source), args.out, args.max_tokens)
    print(args.out)
    return 0
