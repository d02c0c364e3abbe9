"""HTTP servers as child processes: slotserve's own and llama.cpp's, on free loopback ports,
and the memory of a process with its descendants (llama-server's router runs a child
process a model)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slotserve.memory import read_process


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A server started with ``command`` (which must listen on ``port``), ready once
    ``GET /health`` answers 200; stopped with SIGTERM. ``http`` is a client on it for
    requests in a loop or timed: `httpx.post` and its kin build a client, and with it an
    SSL context (the CA bundle read), tens of milliseconds each call."""

    def __init__(self, command: list[str], port: int, ready_timeout_s: float = 120.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        # Output goes to a file: a pipe nobody reads would block the server once full.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log")  # noqa: SIM115 (lives as long as the server)
        self._http: httpx.Client | None = None
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # One client for the polls, keeping no connection open after (a test of the
        # server's per-client connection limit counts every connection from here).
        no_keepalive = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=1, limits=no_keepalive) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited: {self.output()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"server did not become healthy in {timeout_s:.0f} s: {self.output()}")

    @property
    def http(self) -> httpx.Client:
        """A client on the server (relative URLs; a 10-minute timeout unless a call says
        otherwise), made at first use, closed by `stop`."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=600)
        return self._http

    def output(self) -> str:
        """What the server printed so far."""
        self.log.flush()
        with open(self.log.name) as handle:
            return handle.read()

    @functools.cached_property
    def model_name(self) -> str:
        """The served model's name, asked once, on a connection closed after (not the
        kept-alive ``http``: a test of the connection limits counts every open one)."""
        return str(httpx.get(self.url + "/v1/models").json()["data"][0]["id"])

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after 30 s)."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def slotserve_command(model: str, port: int, *flags: str) -> list[str]:
    """``slotserve serve --model MODEL --port PORT FLAGS…`` in this interpreter."""
    command = [sys.executable, "-m", "slotserve.cli", "serve", "--model", model]
    return [*command, "--port", str(port), *flags]


def slotserve_server(model: str, *flags: str, ready_timeout_s: float = 120.0) -> ServerProcess:
    """slotserve's server on ``model`` (`slotserve_command`), on a free port."""
    port = free_port()
    return ServerProcess(slotserve_command(model, port, *flags), port, ready_timeout_s)


def llama_server(
    binary: Path, gguf: Path, *flags: str, parallel: int, threads: int, context: int
) -> ServerProcess:
    """llama.cpp's server on ``gguf``: ``parallel`` slots sharing a ``context`` of
    ``parallel × per-slot`` tokens, ``threads`` threads for decode and prompt alike, then
    ``flags`` (``--embeddings``…)."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["-np", str(parallel), "-c", str(context), "-t", str(threads)]
    command += ["-tb", str(threads), "--no-webui", *flags]
    return ServerProcess(command, port)


def children(pid: int) -> list[int]:
    """The pids of process ``pid``'s children (Linux ``/proc/PID/task/*/children``)."""
    found: list[int] = []
    with contextlib.suppress(OSError):  # ended meanwhile
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as listed:
                found.extend(int(child) for child in listed.read().split())
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        pending.extend(children(current))
    return found


def tree_memory(pids: list[int]) -> tuple[int, int]:
    """The resident and the anonymous bytes of the processes ``pids`` and all their
    descendants, summed (a process that ended meanwhile counts 0)."""
    resident = anonymous = 0
    for root in pids:
        for pid in process_tree(root):
            reading = read_process(pid)
            resident += reading.resident
            anonymous += reading.anonymous
    return resident, anonymous
