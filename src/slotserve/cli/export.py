"""``slotserve export MODEL OUT/``: write a bundle (program, weights, tokenizer, manifest)
that ``serve|generate|bench --model OUT/`` run on the ExecuTorch executor."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "export", help="export a model as a bundle: ExecuTorch program + weights + manifest"
    )
    parser.add_argument("model", help="'bundled', a .gguf file or a Hugging Face model dir")
    parser.add_argument("out", type=Path, help="the bundle directory to write")
    parser.add_argument(
        "--backend",
        choices=("xnnpack", "portable"),
        default="xnnpack",
        help="xnnpack: XNNPACK's CPU kernels; portable: ExecuTorch's portable kernels (fp32)",
    )
    parser.add_argument(
        "--quant",
        choices=("fp32", "8da4w", "8da4w-2pass"),
        default="8da4w-2pass",
        help="8da4w-2pass (the default): int8 dynamic activations x int4 weights in groups of "
        "32 (a Q4_0/Q4_1 GGUF's blocks kept exactly), each projection and the head in two "
        "passes, the second on what the first's int8 activations lost (llama.cpp's agreement "
        "target met; decode steps 1.5-2.4x as long); 8da4w: one pass (faster, less accurate); "
        "fp32: dense weights",
    )
    parser.add_argument(
        "--max-batch-tokens",
        "--max-batch",
        type=int,
        default=512,
        help="largest step in tokens (decode tokens + a prefill chunk) the program takes; "
        "serve it with --max-batch-tokens at most this",
    )
    parser.add_argument(
        "--max-context", type=int, default=None, help="longest sequence (default: the model's)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="threads recorded for the runtime (0: every core)"
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from slotserve.export import ExportOptions, export_bundle, load_for_export

    options = ExportOptions(
        backend=args.backend,
        quant=args.quant,
        max_tokens=args.max_batch_tokens,
        max_context=args.max_context,
        threads=args.threads,
    )
    console = Console(stderr=True)
    began = time.monotonic()
    model = load_for_export(args.model)  # a GGUF with its blocks, read once
    console.print(f"loaded {model.source} in {time.monotonic() - began:.1f} s")
    with console.status(f"exporting to {args.out} (minutes on a 2-core CPU)") as status:

        def progress(message: str) -> None:
            console.print(message)
            status.update(message)

        manifest = export_bundle(model, args.out, options, progress)
    for name, digest in manifest.files.items():
        size = (args.out / name).stat().st_size
        print(f"{args.out / name}  {size / 2**20:.1f} MiB  sha256 {digest[:16]}")
    print(f"{args.out / 'manifest.json'}  schema {manifest.schema}")
    return 0
