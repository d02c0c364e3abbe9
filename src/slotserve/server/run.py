"""`serve`: run the OpenAI-compatible app around an engine with uvicorn.

SIGINT/SIGTERM stop admitting, cancel what runs, and exit 0.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

from slotserve.engine import Engine

log = logging.getLogger("slotserve")


def serve(
    engine: Engine,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    log_level: str = "warning",
) -> int:
    """Serve ``engine`` as ``model_name`` until a signal; returns the exit status."""
    import uvicorn

    from slotserve.server.app import create_app

    app = create_app(engine, model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    log.info("serving %s at http://%s:%s/v1", model_name, host, port)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (the app's lifespan closes the engine)
    # and then re-raises the signal to the handler that was installed before it: make that
    # one exit with status 0, since the shutdown was the one asked for.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
