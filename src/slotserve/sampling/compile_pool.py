"""The bounded pool that compiles grammars from the network (`CompilePool`), under the
bounds of `GrammarConfig` (grammar_config.py).

llguidance offers no way to stop a compile (its `LLParserLimits` fuel does not bound every
step: an ``allOf`` of N patterns takes time and memory exponential in N whatever the
limits), so each compile first runs in a worker process that can be killed, under the time
and memory bounds of `GrammarConfig`; only a job that compiled there within them is built
again in the server's process (the pool's ``finish``), where the grammar is needed. A job
is a JSON schema (structured outputs, a tool's parameters), llguidance grammar text (a
reply's tool calls, a client's Lark grammar), a GBNF grammar or a regular expression (a
client's; converted to llguidance's grammar in the worker too, so a conversion that runs
long is bounded as a compile is). The workers are a bounded pool (`GrammarConfig.workers`, one by
default) at the lowest CPU priority, fed by a queue with a deadline, so compiles never take
the cores the engine decodes on. Each worker runs grammar_worker.py, a program of its own.

Owns the worker processes and their threads; knows nothing of tokenizers beyond the index
source it is handed, nor of what a compile builds here beyond its owner's ``finish``.
Module state: none.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from slotserve.memory import anonymous_bytes
from slotserve.sampling.grammar_config import (
    JSON_OPTIONS,
    MIB,
    GrammarBusy,
    GrammarCancelled,
    GrammarConfig,
    GrammarError,
    GrammarLimitError,
    JobKind,
    first_line,
    grammar_charge,
)

# How often a compile in a worker is checked against its bounds and its cancellation.
POLL_S = 0.01
# The worker's program (grammar_worker.py), run by path in its own interpreter so that it
# imports llguidance alone, never this package (whose import brings torch).
WORKER_SCRIPT = Path(__file__).with_name("grammar_worker.py")

# What a compile builds in this process once its worker proved it bounded (a `Grammar`: the
# pool knows nothing of it beyond its owner's ``finish``).
Built = TypeVar("Built")


class CompileJob(Generic[Built]):
    """One schema (``kind`` ``"schema"``: a JSON schema's text) or grammar (``"grammar"``:
    llguidance's grammar text; ``"gbnf"``, ``"regex"``: see `JobKind`) in the compile
    pool; ``description`` names it in errors.
    ``future`` gives its `Grammar` or raises; `cancel` stops it wherever it is (a worker
    compiling it is killed); `expire` gives up on it if no worker took it yet."""

    def __init__(
        self,
        text: str,
        queue_timeout_s: float,
        reserve: Callable[[int], None] | None = None,
        kind: JobKind = "schema",
        description: str = "JSON schema",
    ) -> None:
        self.text = text
        self.kind = kind
        self.description = description
        self.queue_timeout_s = queue_timeout_s
        self.deadline = time.monotonic() + queue_timeout_s
        self.reserve = reserve
        self.future: concurrent.futures.Future[Built] = concurrent.futures.Future()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
        self.future.cancel()

    def expire(self) -> bool:
        """Give up on a job still queued: True (its future then raises `GrammarBusy`);
        False once a worker has it (it ends within the compile's own bounds)."""
        if self.future.cancel():
            return True
        return self.future.cancelled()

    def result(self, timeout: float | None = None) -> Built:
        """Wait for the grammar: at most until the queue's deadline for a worker, then as
        long as the compile's bounds allow."""
        wait = max(self.deadline - time.monotonic(), 0.0)
        try:
            return self.future.result(timeout=wait if timeout is None else min(wait, timeout))
        except concurrent.futures.TimeoutError:
            if self.expire():
                raise GrammarBusy(self.busy_message()) from None
        return self.future.result(timeout=timeout)

    def busy_message(self) -> str:
        return (
            f"no grammar compile slot came free within --grammar-queue-timeout "
            f"{self.queue_timeout_s:g} s (other schemas are compiling); retry later, or raise "
            "--grammar-workers or --grammar-queue-timeout"
        )


class CompilePool(Generic[Built]):
    """`GrammarConfig.workers` threads, each with one worker process, taking jobs in order
    from one queue. Daemon threads: nothing waits for them at exit, and the workers die
    with this process (PR_SET_PDEATHSIG). A worker builds its tokenizer index from
    ``source()``; a job proven within its bounds there is built here by ``finish(job,
    charge)`` (its grammar, charged ``charge`` bytes)."""

    def __init__(
        self,
        config: GrammarConfig,
        source: Callable[[], tuple[Any, int, list[int]]],
        finish: Callable[[CompileJob[Built], int], Built],
    ) -> None:
        self.config = config
        self.source = source
        self.finish = finish
        self.jobs: queue.Queue[CompileJob[Built] | None] = queue.Queue()
        self.closed = threading.Event()
        self.workers: list[Worker | None] = [None] * self.config.workers
        self.running: list[CompileJob[Built] | None] = [None] * self.config.workers
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(
                target=self._run, args=(i,), name=f"slotserve-grammar-{i}", daemon=True
            )
            for i in range(self.config.workers)
        ]
        for thread in self.threads:
            thread.start()

    def put(self, job: CompileJob[Built]) -> None:
        if self.closed.is_set():
            job.future.set_exception(GrammarCancelled("the grammar compiler is closed"))
            return
        self.jobs.put(job)

    def close(self) -> None:
        self.closed.set()
        for _ in self.threads:
            self.jobs.put(None)
        with self._lock:
            workers, self.workers = self.workers, [None] * len(self.workers)
            for job in self.running:
                if job is not None:
                    job.cancelled.set()
        for worker in workers:
            if worker is not None:
                worker.kill()
        while True:  # what was still queued
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarCancelled("the grammar compiler is closed"))

    def _run(self, slot: int) -> None:
        lower_priority()
        while True:
            job = self.jobs.get()
            if job is None or self.closed.is_set():
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(GrammarCancelled("the grammar compiler is closed"))
                return
            if time.monotonic() > job.deadline:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(GrammarBusy(job.busy_message()))
                continue
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled or expired while queued
            with self._lock:
                self.running[slot] = job
            try:
                job.future.set_result(self._compile(slot, job))
            except BaseException as exc:  # every outcome goes to the waiter
                job.future.set_exception(exc)
            finally:
                with self._lock:
                    self.running[slot] = None
            del job  # waiting for the next one must not keep this one's grammar alive

    def _worker(self, slot: int) -> Worker:
        with self._lock:
            worker = self.workers[slot]
            if worker is None or not worker.alive:
                worker = Worker(self.source())
                self.workers[slot] = worker
        return worker

    def _drop(self, slot: int, worker: Worker) -> None:
        worker.dispose()
        with self._lock:
            if self.workers[slot] is worker:
                self.workers[slot] = None

    def _compile(self, slot: int, job: CompileJob[Built]) -> Built:
        config = self.config
        worker = self._worker(slot)
        try:
            kept = worker.compile(job, config)
        except BaseException:
            self._drop(slot, worker)
            raise
        charge = grammar_charge(kept, config)
        if charge > config.max_bytes:
            raise GrammarLimitError(
                f"its grammar keeps {kept / MIB:.1f} MiB, and with the "
                f"{config.lexer_bytes / MIB:.0f} MiB its lexer may add that is more than "
                f"one grammar's share, --grammar-max-bytes {config.max_bytes / MIB:.0f} MiB; "
                "simplify the schema or raise --grammar-max-bytes",
                "memory",
                config.max_bytes,
            )
        if job.reserve is not None:
            job.reserve(charge)
        if job.cancelled.is_set():
            raise GrammarCancelled("the compile was cancelled")
        # Proven bounded in the worker: this compile takes what that one took.
        return self.finish(job, charge)


def lower_priority() -> None:
    """This thread at the lowest CPU priority (Linux: nice is per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Worker:
    """One worker process: a Python that imports llguidance only (no torch), builds the
    tokenizer index once, then compiles one schema at a time and reports what the grammar
    keeps (malloc's bytes in use). Killed on any bound, cancellation or close.
    ``bare_anonymous`` is its anonymous bytes before it imported llguidance."""

    def __init__(self, source: tuple[Any, int, list[int]]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the server's to handle
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin, self.process.stdout
        self._send(source)
        reply = self._receive()
        if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ready"):
            self.dispose()
            raise GrammarError(f"the grammar worker did not start: {reply!r}")
        self.bare_anonymous = int(reply[1])

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """Kill the process (any thread; a compile reading from it then sees it end)."""
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def dispose(self) -> None:
        """`kill`, and close its pipes (only the thread that compiles with it)."""
        self.kill()
        for stream in (self._in, self._out):
            with contextlib.suppress(OSError):
                stream.close()

    def compile(self, job: CompileJob[Any], config: GrammarConfig) -> int:
        """The bytes the grammar of ``job`` keeps; raises `GrammarError` for a schema
        llguidance refuses, `GrammarLimitError` past a bound, `GrammarCancelled`."""
        baseline = anonymous_bytes(self.process.pid)
        try:
            self._send((job.kind, job.text, JSON_OPTIONS, config.limits()))
        except OSError:  # the worker was killed before it had the schema (a broken pipe)
            if job.cancelled.is_set():  # by close() or a cancel
                raise GrammarCancelled("the compile was cancelled") from None
            raise
        start = time.monotonic()
        peak = 0
        while True:
            ready, _, _ = select.select([self._out], [], [], POLL_S)
            if ready:
                try:
                    reply = self._receive()
                except GrammarError:
                    if job.cancelled.is_set():  # killed by close()
                        raise GrammarCancelled("the compile was cancelled") from None
                    raise
                break
            if job.cancelled.is_set():
                raise GrammarCancelled("the compile was cancelled")
            elapsed = time.monotonic() - start
            if elapsed > config.timeout_s:
                raise GrammarLimitError(
                    f"it did not compile within --grammar-timeout {config.timeout_s:g} s "
                    "(stopped); simplify the schema (fewer combined patterns or alternatives) "
                    "or raise --grammar-timeout",
                    "timeout",
                    config.timeout_s,
                )
            grown = anonymous_bytes(self.process.pid) - baseline
            peak = max(peak, grown)
            if grown > config.max_bytes:
                raise GrammarLimitError(
                    f"compiling it took more than --grammar-max-bytes "
                    f"{config.max_bytes / MIB:.0f} MiB (stopped at {grown / MIB:.0f} MiB after "
                    f"{elapsed:.1f} s); simplify the schema or raise --grammar-max-bytes",
                    "memory",
                    config.max_bytes,
                )
        kind = reply[0]
        if kind == "ok":
            return int(reply[1])
        if kind == "empty":
            raise GrammarError(
                f"{job.description}: it admits no document at all (no first token is "
                "allowed): give every $ref loop a way out, or remove the contradictory keywords"
            )
        if kind == "schema":
            raise GrammarError(f"the JSON schema is not usable: {reply[1]}")
        raise GrammarError(f"{job.description}: {first_line(str(reply[1]))}")

    def _send(self, message: Any) -> None:
        data = pickle.dumps(message)
        self._in.write(struct.pack("<I", len(data)) + data)
        self._in.flush()

    def _receive(self) -> Any:
        head = self._out.read(4)
        if len(head) < 4:
            code = self.process.wait()
            raise GrammarError(f"the grammar worker died compiling it (exit status {code})")
        (size,) = struct.unpack("<I", head)
        return pickle.loads(self._out.read(size))
