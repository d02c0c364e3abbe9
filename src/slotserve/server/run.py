"""``slotserve serve``: load the model, plan and start the engine, run uvicorn.

The engine is built before the port opens, so a plan that does not fit is reported at
once (exit status 2). SIGINT/SIGTERM stop admitting, cancel what runs, and exit 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from slotserve.artifact import load
from slotserve.cli_plan import engine_config
from slotserve.engine import Engine

BUNDLED_NAME = "SmolLM2-135M-Instruct"


def served_name(spec: str) -> str:
    """The model id clients must send: the bundled model's name, or the file/dir name."""
    if spec == "bundled":
        return BUNDLED_NAME
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from slotserve.server.app import create_app

    model = load(args.model, weights=args.weights)
    engine = Engine(model, engine_config(args))  # PlanError if it does not fit
    name = args.served_model_name or served_name(args.model)
    app = create_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    print(f"slotserve: serving {name} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (the app's lifespan closes the engine)
    # and then re-raises the signal to the handler that was installed before it: make that
    # one exit with status 0, since the shutdown was the one asked for.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
