"""The declared cancellation bound over HTTP (issue 26, item 6): ``/slots`` states the
worst-case cancel→release time in its headers (the slot list keeps llama.cpp's shape),
``/metrics`` keeps it beside the measured cancel→release p99, and the dashboard's snapshot
and its cancel tile show it. On the synthetic clock and executor (10 ms a fed token), so
every figure is exact: the largest step the config allows is 64 tokens, 0.64 s."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import slotserve as ss
from slotserve.engine.pressure import PressureSource
from slotserve.server import create_app
from slotserve.server.ops.dashboard import SnapshotFeed
from slotserve.server.ops.metrics import PrometheusMetrics
from tests.engine.test_accounting import STEP_COST_PER_TOKEN
from tests.engine.test_cancel_bound import PARAMS, synthetic_engine

WEB = Path(ss.__file__).parent / "server" / "ops" / "web"
CONFIG = {"max_seqs": 1, "max_context": 256, "prefill_chunk": 64, "max_batch_tokens": 64}


def gauge(text: str, name: str) -> float | None:
    """The value of gauge ``name`` (any labels) in a Prometheus exposition."""
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return None if match is None else float(match.group(1))


def test_slots_and_metrics_state_the_bound_beside_the_measured_p99(tiny: ss.Model) -> None:
    engine, executor, _ = synthetic_engine(tiny, **CONFIG)
    try:
        client = TestClient(create_app(engine, "tiny", web=False))
        # Before any step: the bound is one 64-token step, not yet timed.
        slots = client.get("/slots")
        assert slots.status_code == 200 and len(slots.json()) == 1
        assert slots.headers["x-cancel-bound-step-tokens"] == "64"
        assert slots.headers["x-cancel-bound-basis"] == "unmeasured"
        assert "x-cancel-bound-seconds" not in slots.headers
        assert "x-cancel-release-p99-seconds" not in slots.headers
        text = client.get("/metrics").text
        assert gauge(text, "slotserve_cancel_bound_step_tokens") == 64
        assert gauge(text, "slotserve_cancel_bound_seconds") is None
        assert gauge(text, "slotserve_cancel_release_p99_seconds") is None

        # A 200-token prompt: its first step is a 64-token chunk; cancelled as it begins.
        handle = engine.submit(list(range(10, 210)), PARAMS)
        assert executor.entered.acquire(timeout=10)
        handle.cancel()
        executor.tick(1)
        ack = handle.cancel(wait=True)
        assert ack is not None and ack.latency_s == pytest.approx(64 * STEP_COST_PER_TOKEN)

        slots = client.get("/slots")
        headers = slots.headers
        assert headers["x-cancel-bound-basis"] == "measured"
        assert float(headers["x-cancel-bound-seconds"]) == pytest.approx(0.64)
        assert float(headers["x-cancel-release-p99-seconds"]) == pytest.approx(ack.latency_s)
        assert headers["x-cancel-bound"] == (
            "worst-case cancel->release: 640.0 ms (a 64-token step, measured); "
            "measured p99 640.0 ms over 1 cancels"
        )
        text = client.get("/metrics").text
        assert 'slotserve_cancel_bound_seconds{basis="measured"} 0.64' in text
        assert gauge(text, "slotserve_cancel_release_p99_seconds") == pytest.approx(0.64)
        assert gauge(text, "slotserve_cancel_release_max_seconds") == pytest.approx(0.64)
        # The bound holds: the measured release is within the declared one.
        assert ack.latency_s <= float(headers["x-cancel-bound-seconds"]) + 1e-6

        snapshot = SnapshotFeed(engine, PrometheusMetrics(engine.stats), "tiny").snapshot()
        bound = json.loads(json.dumps(snapshot))["stats"]["cancel_bound"]
        assert bound["basis"] == "measured" and bound["max_step_tokens"] == 64
        assert bound["estimate_s"] == pytest.approx(0.64)
    finally:
        engine.close()


def test_slots_keep_the_pressure_header_beside_the_bound(tiny: ss.Model) -> None:
    pressure = PressureSource(lambda: 2.0)
    config = ss.EngineConfig(max_seqs=2, max_context=64)
    with ss.Engine(tiny, config, pressure=pressure) as engine:
        headers = TestClient(create_app(engine, "tiny", web=False)).get("/slots").headers
        steps = engine.cancel_bound().max_step_tokens
    assert headers["x-pressure-level"] == "2"
    assert headers["x-cancel-bound-step-tokens"] == str(steps)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's module")
def test_the_dashboard_s_cancel_tile_shows_the_bound() -> None:
    """The page's own ``boundText`` (dashboard.js), run by node on the three cases."""
    source = (WEB / "dashboard.js").read_text()  # a module importing the page's others:
    start = source.index("function ms(")  # so run its helpers alone
    end = source.index("function setText(")
    program = source[start:end] + (
        "for (const b of [null,"
        " {estimate_s: null, max_step_tokens: 64, basis: 'unmeasured'},"
        " {estimate_s: 0.0123, max_step_tokens: 512, basis: 'measured'}])"
        " console.log(JSON.stringify(boundText(b)));"
    )
    out = subprocess.run(
        ["node", "-e", program], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()
    assert [json.loads(line) for line in out] == [
        "",
        "bound: one 64-token step",
        "bound 12.3 ms (512-token step, measured)",
    ]
