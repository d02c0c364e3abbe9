"""``slotserve plan`` counts what ``slotserve serve`` checks with the same flags: the grammars
arena (``--grammar-cache-bytes``, serve's default too) and every computed arena, compared
with the plan a real server holds (its dashboard feed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slotserve.bench.worst_case import dashboard_snapshot
from slotserve.cli import main
from slotserve.cli.serve import DEFAULT_GRAMMAR_CACHE_BYTES
from slotserve.memory import parse_bytes
from tests.server.conftest import ServerProcess

FLAGS = ("--max-seqs", "2", "--max-context", "256", "--kv-layout", "cell")


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", *argv, "--json"]) == 0
    report: dict[str, object] = json.loads(capsys.readouterr().out)
    return report


def test_plan_counts_the_grammars_arena_serve_checks(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_dirs["llama"])
    default = _plan(capsys, "--model", model, *FLAGS)
    assert default["arenas"]["grammars"] == parse_bytes(DEFAULT_GRAMMAR_CACHE_BYTES)  # type: ignore[index]
    chosen = ("--grammar-max-bytes", "4MiB", "--grammar-cache-bytes", "6MiB")
    planned = _plan(capsys, "--model", model, *FLAGS, *chosen)
    arenas: dict[str, int] = planned["arenas"]  # type: ignore[assignment]
    assert arenas["grammars"] == 6 * 2**20
    assert planned["worst_case_bytes"] == sum(arenas.values())
    server = ServerProcess(model, *FLAGS, *chosen)
    try:
        served: dict[str, int] = dashboard_snapshot(server.url)["plan"]["arenas"]
    finally:
        assert server.stop() == 0
    assert served.keys() == arenas.keys()
    # The computed arenas are equal to the byte; runtime and weights are measured at each
    # process's own load (this one has loaded models before), so they are not compared.
    for name in ("kv", "activations", "grammars", "responses"):
        assert served[name] == arenas[name], name


def test_plan_refuses_the_grammar_flags_serve_refuses(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", str(tiny_dirs["llama"]), *FLAGS, "--grammar-cache-bytes", "1MiB"]
    assert main(argv) == 2
    assert "--grammar-cache-bytes" in capsys.readouterr().err
