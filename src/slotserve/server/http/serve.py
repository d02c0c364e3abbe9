"""`serve`: run the OpenAI-compatible app around an engine with uvicorn.

Shutdown cancels rather than waits. On SIGINT/SIGTERM the app stops admitting at once (new
requests get 503 with an OpenAI error body), the engine is closed (running requests are
cancelled at the next step boundary: open streams end with an error event and ``[DONE]``,
non-streamed requests get 503), uvicorn then has a short grace period to send those last
bytes, and `serve` returns 0. A second SIGINT skips the grace period.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn

from slotserve.engine import Engine
from slotserve.engine.models import ModelSet
from slotserve.memory import Meter, trim_heap
from slotserve.sampling.grammar import GrammarCompiler
from slotserve.server.chat.defaults import SamplingDefaults
from slotserve.server.chat.reasoning import ReasoningFormat
from slotserve.server.http.app import create_app
from slotserve.server.http.connections import ConnectionTracker, HTTPLimits
from slotserve.server.http.protocol import protocol_for
from slotserve.server.http.state import ServerState

log = logging.getLogger("slotserve")

# After the engine is closed, open responses need only their last chunks sent; a client
# that does not read them is not waited for longer than this.
SHUTDOWN_GRACE_S = 1
# How long an idle kept-alive connection stays open between requests.
KEEP_ALIVE_S = 5
# Descriptors the process needs besides its connections (model files, logs, the loop).
RESERVED_FDS = 64


def serve(
    engine: Engine,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    log_level: str = "warning",
    limits: HTTPLimits | None = None,
    sampling: SamplingDefaults | None = None,
    metrics_key: str | None = None,
    cors_origins: Sequence[str] = (),
    web: bool = True,
    reasoning_format: ReasoningFormat = "auto",
    grammar_compiler: GrammarCompiler | None = None,
    models: ModelSet | None = None,
) -> int:
    """Serve ``engine`` as ``model_name`` until SIGINT/SIGTERM; returns the exit status (0).

    ``limits``: the deadlines on request heads and bodies and the caps on open connections
    (`HTTPLimits`; its defaults if None); ``sampling`` fills the fields a request leaves
    out (logged here, at startup); ``metrics_key`` guards /metrics; ``cors_origins`` may
    call the API from a browser; ``reasoning_format`` is how a thinking model's reasoning
    is returned when a request does not say (`reasoning`); ``grammar_compiler``, one whose
    tokenizer index was built at start, serves the structured outputs; ``models``, a set
    of models served in one process (``engine`` its first resident model's), routes each
    request by its ``model`` field."""
    limits = limits or HTTPLimits()
    connections = ConnectionTracker(limits)
    # What the start keeps joins the start arena of the ledger whose budget is the whole
    # process's, checked again after: a set's device ledger, or the engine's in process
    # scope (a model budget leaves the process out).
    check: Callable[[], None] | None = None
    ledger = engine.ledger
    if models is not None and models.ledger is not None:
        ledger, check = models.ledger, models.check
    elif engine.config.budget_scope == "process":
        check = lambda: engine.plan.check()  # noqa: E731 (the plan as it stands then)
    meter = ledger.meter("the server's start")
    app = create_app(
        engine,
        model_name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        sampling=sampling,
        metrics_key=metrics_key,
        cors_origins=cors_origins,
        web=web,
        connections=connections,
        reasoning_format=reasoning_format,
        grammar_compiler=grammar_compiler,
        models=models,
    )
    warn_if_exposed(host, api_key)
    warn_if_descriptors_short(limits.max_connections)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol_for(connections),
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    served = ", ".join(models.names) if models is not None else model_name
    log.info("serving %s at http://%s:%s/v1", served, host, port)
    log.info("sampling defaults: %s", app.state.server.sampling.describe())
    if cors_origins:
        log.info("CORS: allowing %s", ", ".join(cors_origins))
    CancellingServer(config, app.state.server, engine, meter, check).run()
    return 0


class CancellingServer(uvicorn.Server):
    """uvicorn's server whose shutdown closes the engine first, instead of waiting for
    running requests to finish on their own; its start adds what it left (the app, the
    HTTP stack: the anonymous growth ``meter`` reads) to its ledger's start arena and runs
    ``check`` (`PlanError` if the budget no longer holds the plan); without ``check`` the
    budget leaves the process out and nothing is added."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        engine: Engine,
        meter: Meter,
        check: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.engine = engine
        self.meter = meter
        self.check = check

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        trim_heap()
        if self.check is not None:
            kept = self.meter.mark("start").bytes
            self.check()  # PlanError: the budget no longer holds the plan
            log.info("the server's start kept %.1f MiB (start arena)", kept / 2**20)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it only sets flags; the event loop acts on them within a tick.
        # The signal is not kept for uvicorn to re-raise after serving (its default), since
        # the shutdown was the one asked for and the process should exit 0.
        self.state.stop_admitting()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.begin_shutdown()  # cancels running requests; their responses end now
        await super().shutdown(sockets)


def warn_if_exposed(host: str, api_key: str | None) -> bool:
    """Warn, loudly, when ``host`` accepts connections from other machines and no API key
    guards the server; returns whether it warned."""
    if api_key is not None or _is_loopback(host):
        return False
    log.warning(
        "WARNING: serving on %r, reachable from other machines, with no API key: anyone who "
        "can reach this port can run the model and see /slots. Pass --api-key KEY, or bind "
        "--host 127.0.0.1.",
        host,
    )
    return True


def warn_if_descriptors_short(max_connections: int) -> bool:
    """Warn when the process may not open ``max_connections`` sockets and its own files
    (the soft ``RLIMIT_NOFILE``); returns whether it warned."""
    try:
        import resource
    except ImportError:  # not a Unix: no such limit to read
        return False
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or max_connections + RESERVED_FDS <= soft:
        return False
    log.warning(
        "WARNING: --max-connections %d plus %d descriptors of the process's own exceed its "
        "open-file limit of %d: connections would fail to open before the cap refuses them. "
        "Raise the limit (ulimit -n %d) or pass --max-connections %d.",
        max_connections, RESERVED_FDS, soft,
        max_connections + RESERVED_FDS, max(1, soft - RESERVED_FDS),
    )  # fmt: skip
    return True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: assume it is reachable
        return False
