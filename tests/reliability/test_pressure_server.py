"""Device pressure driven through ``serve --pressure file:PATH`` on a real server process:
background is refused with ``pressure`` (HTTP 429) while the level is high, interactive
work still runs, and background is admitted again once the level drops; with several
models in the process, the one signal reaches every model's engine."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess


def complete(server: ServerProcess, model: str, priority: str) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "priority": priority}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=30)


def pressure_gauge(server: ServerProcess) -> float | None:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("slotserve_pressure_level "):
            return float(line.split()[1])
    return None


def write_level(path: Path, level: float) -> None:
    """Write as an app shell would: a whole file replaced at once (no torn reads)."""
    scratch = path.with_suffix(".tmp")
    scratch.write_text(f"{level}\n")
    scratch.replace(path)


def test_file_pressure_pauses_then_resumes_background(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    level = tmp_path / "pressure"
    write_level(level, 0.0)
    # --queue-depth 0: a background request meets the pressure at admission and is
    # refused at once (with a queue it would wait in the queue for the level to drop).
    server = ServerProcess(
        str(tiny_dirs["llama"]),
        *("--max-context", "256", "--queue-depth", "0", "--pressure", f"file:{level}"),
    )
    try:
        model = server.model_name
        assert complete(server, model, "background").status_code == 200
        assert pressure_gauge(server) == 0.0

        write_level(level, 2.0)
        refused = complete(server, model, "background")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "pressure"
        assert "pressure" in refused.json()["error"]["message"]
        assert complete(server, model, "interactive").status_code == 200
        assert pressure_gauge(server) == 2.0
        assert httpx.get(server.url + "/slots").headers["x-pressure-level"] == "2"
        metrics = httpx.get(server.url + "/metrics").text
        assert 'slotserve_admissions_refused_total{reason="pressure"} 1.0' in metrics

        write_level(level, 0.2)
        deadline = time.monotonic() + 5
        while (answer := complete(server, model, "background")).status_code != 200:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.05)
        assert pressure_gauge(server) == 0.2
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


def test_pressure_reaches_every_model_of_a_set(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    level = tmp_path / "pressure"
    write_level(level, 2.0)
    server = ServerProcess(
        f"chat={tiny_dirs['llama']}",
        *("--model", f"other={tiny_dirs['qwen2']}", "--max-context", "128"),
        *("--queue-depth", "0", "--pressure", f"file:{level}"),
    )
    try:
        for model in ("chat", "other"):
            refused = complete(server, model, "background")
            assert refused.status_code == 429, (model, refused.text)
            assert refused.json()["error"]["code"] == "pressure", model
            assert complete(server, model, "interactive").status_code == 200, model
        write_level(level, 0.0)
        for model in ("chat", "other"):
            deadline = time.monotonic() + 5
            while (answer := complete(server, model, "background")).status_code != 200:
                assert time.monotonic() < deadline, (model, answer.text)
                time.sleep(0.05)
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()
