"""`ServerState`: what the routes share (engine, model name, metrics, settings), and the
server's shutdown: stop admitting, then close the engine off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from slotserve.engine import Engine
from slotserve.engine.models import ModelSet
from slotserve.sampling.grammar import GrammarCompiler
from slotserve.server.chat.defaults import SamplingDefaults
from slotserve.server.chat.reasoning import ReasoningFormat
from slotserve.server.chat.structured import GrammarCache
from slotserve.server.http.connections import ConnectionTracker
from slotserve.server.ops.metrics import PrometheusMetrics
from slotserve.server.responses.store import ResponseStore

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass
class ServerState:
    engine: Engine | None
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics: PrometheusMetrics | None = None
    created: int = 0
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    metrics_key: str | None = None
    shutting_down: bool = False
    grammars: GrammarCache | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's
    # The connections of the server this app runs in (`serve`); None when served otherwise.
    connections: ConnectionTracker | None = None
    # How a thinking model's reasoning is returned when a request does not say
    # (``--reasoning-format``): apart ("auto"), or inline in the content ("none").
    reasoning_format: ReasoningFormat = "auto"
    # The compiler whose tokenizer index ``serve`` built (and counted in the plan) at
    # start: the grammar cache takes it instead of building a second index.
    grammar_compiler: GrammarCompiler | None = None
    # The served set when the server serves several models (`serve --model A --model B`);
    # None for the one model. ``engine`` is then the first resident model's.
    models: ModelSet | None = None
    _views: dict[str, tuple[Any, ServerState]] = field(default_factory=dict, repr=False)
    _closer: threading.Thread | None = field(default=None, repr=False)
    _id_base: str = field(default_factory=lambda: secrets.token_hex(8), repr=False)
    _id_count: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    def response_id(self, kind: str) -> str:
        """A new response id, ``kind-`` and 24 hex digits: a base drawn once per server,
        then a count, so ids never repeat on this server and hardly across servers. Not a
        ``uuid4`` a response: its ``os.urandom`` releases the GIL right after the submit
        has woken the engine thread, and the route then waited for the step to hand the
        GIL back, once for every response."""
        return f"{kind}-{self._id_base}{next(self._id_count):08x}"

    def attach(self, engine: Engine) -> None:
        """Serve ``engine``: its finished requests feed the Prometheus metrics. A served
        set's metrics read every model (labelled ``model``); its other models' engines are
        hooked as requests reach them (`view_of`)."""
        self.engine = engine
        connections = self.connections.stats if self.connections is not None else None
        if self.models is None:
            self.metrics = PrometheusMetrics(engine.stats, connections, lambda: engine.plan.arenas)
            engine.on_finished = self.metrics.observe
        else:
            self.metrics = PrometheusMetrics(
                engine.stats, connections, models=self.models, primary=self.model_name
            )
            engine.on_finished = self.metrics.observer(self.model_name)
        self.grammars = GrammarCache(engine.model, compiler=self.grammar_compiler)

    def view_of(self, name: str, engine: Any) -> ServerState:
        """This state as a request to model ``name`` (served by ``engine``) sees it: its
        name in replies, its grammar cache and sampling defaults; everything else shared.
        One view per loaded engine (a reloaded model gets a new one), made before the
        request is submitted: its engine's ended requests then feed the metrics under
        ``name``. An encoder engine's view has no grammars."""
        if engine is self.engine:
            return self
        known = self._views.get(name)
        if known is not None and known[0] is engine:
            return known[1]
        loaded = self.models.loaded(name) if self.models is not None else None
        compiler = loaded.grammar_compiler if loaded is not None else None
        sampling = loaded.sampling_defaults if loaded is not None else None
        if isinstance(engine, Engine) and self.metrics is not None:
            engine.on_finished = self.metrics.observer(name)  # before its first request
        view = dataclasses.replace(
            self,
            engine=engine,
            model_name=name,
            sampling=sampling or self.sampling,
            grammars=GrammarCache(engine.model, compiler=compiler)
            if isinstance(engine, Engine)
            else None,
            grammar_compiler=compiler,
            _views={},
        )
        self._views[name] = (engine, view)
        return view

    def grammars_of(self, engine: Engine) -> GrammarCache:
        """The grammar cache of the served model (made by `attach`)."""
        assert self.grammars is not None and engine is self.engine, "attach() the engine first"
        return self.grammars

    def stop_admitting(self) -> None:
        """New requests get 503 from now on. Only sets a flag: safe in a signal handler."""
        self.shutting_down = True

    def begin_shutdown(self) -> None:
        """Stop admitting and close the engine, which cancels running requests at its next
        step boundary (their handles end with a ``cancelled`` Finished). The close runs in a
        thread of its own, since it waits for the engine thread; returns at once."""
        self.stop_admitting()
        if self.engine is None or self._closer is not None:
            return
        close = self.engine.close if self.models is None else self.models.close
        self._closer = threading.Thread(target=close, name="slotserve-shutdown", daemon=True)
        self._closer.start()

    async def finish_shutdown(self) -> None:
        """`begin_shutdown`, then wait (without blocking the event loop) for the engine to
        be closed and its pool back at baseline."""
        self.begin_shutdown()
        if self._closer is not None:
            await asyncio.to_thread(self._closer.join)
