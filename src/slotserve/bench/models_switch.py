"""``bench models``, last part: switching between two chat models that do not both fit, on
slotserve's model set and on llama-server's router (``--models-dir`` with
``--models-max 1``), on the same files.

slotserve serves a third chat model resident (a set answers its own routes on a resident
chat model) and the two on demand (``resident = false``), under a budget with room for the
resident and one of them (`switch_budget`: the plans a start without a budget measured,
plus half the smaller one's), so a request for the unloaded one unloads the other first. The
router starts a child process a model and keeps one at a time. The requests alternate
between the two models, each repeat once each way, each request the first since its
model was unloaded (checked in ``/v1/models`` before it is sent: ``cold_checked``), then
once more warm. The figure is the client's time to the first streamed token of a short
plain completion: the load, the prompt and one token. Memory is the whole process tree's (the
router's children too): resident and anonymous, sampled every `SAMPLE_S` through the
switches (peak) and at the end.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from slotserve.bench.processes import ServerProcess, free_port, tree_memory
from slotserve.bench.stats import summary

SAMPLE_S = 0.02
SWITCH_CONTEXT = 2048  # each chat model's context (one slot each), on both servers
QUESTION = "The colour of the sea is"


class TreeSampler:
    """The peak resident and anonymous bytes of a process tree, sampled on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_resident = self.peak_anonymous = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            resident, anonymous = tree_memory([self.pid])
            self.peak_resident = max(self.peak_resident, resident)
            self.peak_anonymous = max(self.peak_anonymous, anonymous)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def first_token_s(url: str, model: str) -> float:
    """Seconds from sending a streamed completion of a short plain prompt (a model without
    a chat template takes it too) to its first token with text."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    sent = time.perf_counter()
    stream = client.completions.create(
        model=model, prompt=QUESTION, max_tokens=4, temperature=0, stream=True
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    return (first or time.perf_counter()) - sent


def model_states(url: str) -> dict[str, str]:
    """Each served model's state from ``/v1/models``: slotserve's ``slotserve.state``,
    llama-server's router ``status.value``."""
    states = {}
    for card in httpx.get(url + "/v1/models", timeout=30).json()["data"]:
        state = card.get("slotserve", {}).get("state") or card.get("status", {}).get("value")
        states[str(card["id"])] = str(state)
    return states


def alternate(
    server: ServerProcess, names: tuple[str, str], repeats: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Ask each model in turn, cold then warm, ``repeats`` times; the figures."""
    cold: dict[str, list[float]] = {name: [] for name in names}
    warm: dict[str, list[float]] = {name: [] for name in names}
    checked = True
    sampler = TreeSampler(server.process.pid)
    try:
        for repeat in range(repeats):
            for name in names:
                states = model_states(server.url)
                checked = checked and states.get(name) == "unloaded"
                cold[name].append(first_token_s(server.url, name))
                warm[name].append(first_token_s(server.url, name))
                progress(
                    f"repeat {repeat + 1}: {name} was {states.get(name)}: first token "
                    f"{cold[name][-1]:.2f} s, then {warm[name][-1] * 1000:.0f} ms loaded"
                )
    finally:
        sampler.stop()
    resident, anonymous = tree_memory([server.process.pid])
    return {
        "models": list(names),
        "first_token_s_cold": {name: summary(cold[name]) for name in names},
        "first_token_ms_warm": {name: summary([x * 1000 for x in warm[name]]) for name in names},
        "cold_checked": checked,
        "peak_resident_bytes": sampler.peak_resident,
        "peak_anonymous_bytes": sampler.peak_anonymous,
        "resident_bytes": resident,
        "anonymous_bytes": anonymous,
    }


def models_file(directory: Path, resident: str, chats: dict[str, str], context: int) -> Path:
    """The set's TOML: ``resident`` as ``chat``, ``chats`` on demand, one slot of
    ``context`` tokens each."""
    lines = ["[models.chat]", f"source = {json.dumps(resident)}", "max_seqs = 1"]
    lines += [f"max_context = {context}", ""]
    for name, source in chats.items():
        lines += [f"[models.{name}]", f"source = {json.dumps(source)}", "resident = false"]
        lines += ["max_seqs = 1", f"max_context = {context}", ""]
    path = directory / "models.toml"
    path.write_text("\n".join(lines))
    return path


def switch_budget(command: list[str]) -> tuple[int, dict[str, int]]:
    """A budget with room for the resident models and one on-demand model, and each
    model's planned bytes, from the server ``command`` (without a budget) once started:
    the shared arenas (``/metrics``) and each model's plan (``/v1/models``) as that
    server measured them. The margin is half the smaller on-demand plan, against the
    few pages one start measures apart from the next."""
    port = free_port()
    server = ServerProcess([*command, "--port", str(port)], port, ready_timeout_s=600)
    try:
        cards = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    shared = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("slotserve_models_shared_bytes ")
    )
    planned = {str(card["id"]): int(card["slotserve"]["bytes"]) for card in cards}
    resident = sum(planned[str(c["id"])] for c in cards if c["slotserve"]["resident"])
    on_demand = [planned[str(c["id"])] for c in cards if not c["slotserve"]["resident"]]
    budget = int(shared) + resident + max(on_demand) + min(on_demand) // 2
    return budget, planned


def slotserve_switching(
    resident: str,
    chats: dict[str, str],
    threads: int,
    repeats: int,
    progress: Callable[[str], None],
    context: int = SWITCH_CONTEXT,
) -> dict[str, Any]:
    """The switches on slotserve's model set (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-models-") as tmp:
        models = models_file(Path(tmp), resident, chats, context)
        command = [sys.executable, "-m", "slotserve.cli", "serve", "--models", str(models)]
        command += ["--threads", str(threads), "--no-web"]
        progress("slotserve serve --models, no budget: each model's plan")
        budget, planned = switch_budget(command)
        port = free_port()
        command += ["--memory-budget", str(budget), "--port", str(port)]
        progress("slotserve serve --models: starting (each model is loaded and measured once)")
        server = ServerProcess(command, port, ready_timeout_s=600)
        try:
            result = alternate(server, tuple(chats), repeats, progress)  # type: ignore[arg-type]
        finally:
            server.stop()
    return {**result, "budget_bytes": budget, "planned_bytes": planned}


def router_switching(
    binary: Path,
    ggufs: dict[str, Path],
    threads: int,
    repeats: int,
    progress: Callable[[str], None],
    context: int = SWITCH_CONTEXT,
) -> dict[str, Any]:
    """The switches on llama-server's router over a directory of links to ``ggufs`` (each
    named as the model it serves), one slot each of ``context`` tokens."""
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-router-") as tmp:
        directory = Path(tmp)
        for name, gguf in ggufs.items():
            (directory / f"{name}.gguf").symlink_to(gguf.resolve())
        port = free_port()
        command = [str(binary), "--models-dir", str(directory), "--models-max", "1"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--no-webui"]
        command += ["-np", "1", "-c", str(context), "-t", str(threads)]
        command += ["-tb", str(threads)]
        progress("llama-server --models-dir --models-max 1: starting")
        server = ServerProcess(command, port)
        try:
            return alternate(server, tuple(ggufs), repeats, progress)  # type: ignore[arg-type]
        finally:
            server.stop()
