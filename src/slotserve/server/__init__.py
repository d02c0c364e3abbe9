"""OpenAI-compatible HTTP API (FastAPI + uvicorn) with SSE streaming, admission refusals as
HTTP statuses, Prometheus metrics and a slots view. `create_app` builds it around an engine;
`serve` runs it."""

from slotserve.server.http.app import create_app
from slotserve.server.http.serve import serve

__all__ = ["create_app", "serve"]
