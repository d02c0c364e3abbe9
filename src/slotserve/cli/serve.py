"""``slotserve serve``: load the model, plan and start the engine, serve it over HTTP.

The engine is built before the port opens, so a plan that does not fit is reported at
once (exit status 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from slotserve.cli.flags import add_engine_args, engine_config

# The server's default, repeated so that `--help` does not import the HTTP stack.
DEFAULT_HEADER_TIMEOUT_S = 5.0

BUNDLED_NAME = "SmolLM2-135M-Instruct"


def register(commands: Any) -> None:
    parser = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; any other warns unless --api-key is given)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection may take to send a whole request head "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g}); slower ones are closed",
    )
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--no-web", action="store_true", help="no web page at / (chat, dashboard)")


def served_name(spec: str) -> str:
    """The model id clients must send: the bundled model's name, or the file/dir name."""
    if spec == "bundled":
        return BUNDLED_NAME
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name


def run(args: argparse.Namespace) -> int:
    from slotserve.artifact import load
    from slotserve.engine import Engine
    from slotserve.server import serve

    model = load(args.model, weights=args.weights)
    engine = Engine(model, engine_config(args))  # PlanError if it does not fit
    return serve(
        engine,
        args.served_model_name or served_name(args.model),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        header_timeout_s=args.header_timeout,
        web=not args.no_web,
    )
