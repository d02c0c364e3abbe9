"""``slotserve plan`` counts what ``slotserve serve`` checks with the same flags: the grammars
arena (``--grammar-cache-bytes``, serve's default too) and every computed arena, compared
with the plan a real server holds (its dashboard feed); and a preset's least budget, where
``plan`` says it fits, is where a real ``serve`` starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from slotserve.bench.processes import free_port, slotserve_command
from slotserve.bench.worst_case import dashboard_snapshot
from slotserve.cli import main
from slotserve.cli.plan import PLAN_MARGIN
from slotserve.cli.serve import DEFAULT_GRAMMAR_CACHE_BYTES, START_RESERVE
from slotserve.engine.presets import PRESET_NAMES
from slotserve.memory import parse_bytes
from slotserve.server.responses.store import DEFAULT_STORED_BYTES
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


def test_a_server_that_cannot_chat_plans_no_stored_responses(
    tiny_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Responses API answers through the chat template: a model without one answers
    every Responses request 400 and stores none, so neither plan nor serve counts the
    stored responses' arena for it; with a template both count its byte budget."""
    directory = tmp_path / "no-template"
    shutil.copytree(tiny_dirs["llama"], directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    chats = _plan(capsys, "--model", str(tiny_dirs["llama"]), *FLAGS)["arenas"]
    assert chats["responses"] == DEFAULT_STORED_BYTES  # type: ignore[index]
    planned: dict[str, int] = _plan(capsys, "--model", str(directory), *FLAGS)["arenas"]  # type: ignore[assignment]
    assert "responses" not in planned
    server = ServerProcess(str(directory), *FLAGS)
    try:
        served = dashboard_snapshot(server.url)["plan"]["arenas"]
        body = {"model": server.model_name, "input": "hi"}
        refused = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    finally:
        assert server.stop() == 0
    assert served.keys() == planned.keys() and refused.status_code == 400


def test_plan_refuses_the_grammar_flags_serve_refuses(
    tiny_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", str(tiny_dirs["llama"]), *FLAGS, "--grammar-cache-bytes", "1MiB"]
    assert main(argv) == 2
    assert "--grammar-cache-bytes" in capsys.readouterr().err


def _least_budget(preset: str) -> int:
    """``slotserve plan --preset PRESET --json``'s least budget, from a process of its own
    (as a user runs it: in the test worker it would measure the worker)."""
    argv = ["plan", "--model", "bundled", "--preset", preset, "--memory-budget", "4GiB"]
    done = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", *argv, "--json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    least: int = json.loads(done.stdout)["preset"]["least_budget_bytes"]
    return least


# Two processes' measured arenas read apart by up to 3 MiB (the tokenizer's) and a few
# hundred KiB (the grammar compiler's): plan's margin covers serve reading more than plan,
# and this covers serve reading less.
SPREAD = 7 << 19


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_serve_starts_at_the_least_budget_plan_says_a_preset_fits(preset: str) -> None:
    """At the least budget ``plan`` gives a preset, a real ``serve`` starts and holds its
    plan; below it by plan's margin and `SPREAD`, serve refuses before it serves (exit 2,
    the plan's reason). Both commands run with serve's defaults: its
    grammars, its stored responses, its start."""
    least = _least_budget(preset)
    flags = ("--preset", preset, "--memory-budget")
    refused = least - PLAN_MARGIN - SPREAD
    below = subprocess.run(
        slotserve_command("bundled", free_port(), *flags, str(refused)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert below.returncode == 2, below.stderr[-2000:]
    assert "does not fit" in below.stderr, below.stderr[-2000:]
    server = ServerProcess("bundled", *flags, str(least))
    try:
        plan = dashboard_snapshot(server.url)["plan"]
    finally:
        assert server.stop() == 0, server.output()
    assert plan["fits"] and plan["memory_budget"] == least, plan
    assert plan["arenas"]["start"] == START_RESERVE  # what the start kept fitted its reserve
