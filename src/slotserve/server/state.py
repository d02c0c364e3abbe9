"""`ServerState`: what the routes share (engine, model name, metrics, settings)."""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.engine import Engine
from slotserve.server.metrics import PrometheusMetrics

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass
class ServerState:
    engine: Engine | None
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics: PrometheusMetrics | None = None
    created: int = 0

    def attach(self, engine: Engine) -> None:
        """Serve ``engine``: its finished requests feed the Prometheus metrics."""
        self.engine = engine
        self.metrics = PrometheusMetrics(engine.stats)
        engine.on_finished = self.metrics.observe
