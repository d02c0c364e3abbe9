"""``slotserve bench memory --baselines``: both servers' whole resident set side by side at
4 slots x 2,048 tokens (issue 27's target is the ratio), its refusal without llama-server,
and its report."""

from __future__ import annotations

from pathlib import Path

import pytest

import slotserve as ss
from slotserve.bench.llama_server import ENV_BINARY, find_llama_server
from slotserve.bench.memory_side import run_side_by_side
from slotserve.bench.report import _memory_side_by_side


def test_side_by_side_is_skipped_without_llama_server(
    tiny: ss.Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run_side_by_side(tiny)
    assert "make bench-deps" in result["skipped"]
    assert "skipped" in _memory_side_by_side(result)[0]


@pytest.mark.skipif(find_llama_server() is None, reason="llama-server: `make bench-deps`")
def test_side_by_side_with_llama_server_reads_both_whole_processes() -> None:
    # Short prompts keep this to seconds (the bench sends 1,500-token ones).
    result = run_side_by_side(ss.load("bundled"), prompt_tokens=200, decode_tokens=8)
    for name, server in result["servers"].items():
        assert 0 < server["ready_bytes"] <= server["peak_bytes"], name
        assert server["after_bytes"] <= server["peak_bytes"], name
    ours = result["servers"]["slotserve"]
    # The idle engine gives the step's freed activations back (`IDLE_TRIM_S`).
    assert ours["paused_bytes"] <= ours["after_bytes"]
    assert all(ratio > 0 for ratio in result["ratios"].values())
    table = _memory_side_by_side(result)
    assert any(line.startswith("| resident peak |") for line in table)
    assert any(line.startswith("| anonymous at ready |") for line in table)
