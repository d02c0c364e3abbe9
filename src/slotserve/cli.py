"""The ``slotserve`` command line: generate · chat · inspect · bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from slotserve.errors import SlotserveError


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled", help="'bundled', a .gguf file or an HF dir")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-context", type=int, default=None)
    add_weights_arg(parser)


def add_weights_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=["fp32", "int8"],
        default="fp32",
        help="int8: quantised projections, faster decode, less exact",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that sizes a KV pool."""
    add_weights_arg(parser)
    parser.add_argument("--max-seqs", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--kv-layout", choices=["flat", "ring", "cell"], default="flat")
    parser.add_argument("--kv-dtype", choices=["fp32", "fp16", "bf16", "int8"], default="fp32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="cell layout: blocks in the pool"
    )
    parser.add_argument("--ring-window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=0)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--policy", choices=["isolate", "fifo"], default="isolate")
    parser.add_argument("--queue-depth", type=int, default=0)
    parser.add_argument("--queue-timeout", type=float, default=30.0)
    parser.add_argument("--memory-budget", default=None, help="e.g. 1GiB, 512MB, 1073741824")
    parser.add_argument(
        "--memory-map",
        default=None,
        metavar="W,K,A",
        help="per-arena budgets: weights,kv,activations (e.g. 600MiB,256MiB,128MiB)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream a completion of PROMPT")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead")
    _add_sampling_args(generate)
    chat = commands.add_parser("chat", help="interactive terminal chat")
    chat.add_argument("--system", default=None, help="system message")
    _add_sampling_args(chat)
    inspect = commands.add_parser("inspect", help="print a model's metadata and size")
    inspect.add_argument("model")
    plan = commands.add_parser("plan", help="memory plan for a model and engine settings")
    plan.add_argument("--model", default="bundled")
    add_engine_args(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--measure", action="store_true", help="also allocate the pool and measure it"
    )
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", default="bundled")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--log-level", default="warning")
    add_engine_args(serve)
    bench = commands.add_parser("bench", help="measure a model (default: the bundled one)")
    bench.add_argument(
        "scenario",
        choices=["single", "concurrency", "mixed", "bargein", "layouts", "memory", "all"],
    )
    bench.add_argument("--model", default="bundled")
    add_weights_arg(bench)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--json", dest="json_path", default=None, help="write results as JSON")
    bench.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG plot")
    bench.add_argument("--markdown", action="store_true", help="print a markdown report")
    bench.add_argument(
        "--baselines",
        action="store_true",
        help="single: also run transformers / llama-cpp-python on the same weights",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from slotserve.cli_run import run_generate

            return run_generate(args)
        if args.command == "chat":
            from slotserve.cli_run import run_chat

            return run_chat(args)
        if args.command == "inspect":
            from slotserve.cli_run import run_inspect

            return run_inspect(args)
        if args.command == "serve":
            from slotserve.server.run import run_serve

            return run_serve(args)
        if args.command == "plan":
            from slotserve.cli_plan import run_plan

            return run_plan(args)
        from slotserve.bench import run_bench

        return run_bench(args)
    except (SlotserveError, ValueError) as exc:
        print(f"slotserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def print_json(value: object) -> None:
    print(json.dumps(value, indent=None, ensure_ascii=False))


if __name__ == "__main__":
    sys.exit(main())
