"""The bounded pool that compiles grammars from the network (`CompilePool`), and the
bounds it applies (`GrammarConfig`).

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
the cores the engine decodes on.

Owns the worker processes and their threads; knows nothing of tokenizers beyond the index
source it is handed. Module state: none.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from slotserve.memory import anonymous_bytes

if TYPE_CHECKING:
    from slotserve.sampling.grammar import Grammar

# JSON output uses fixed separators and no other whitespace: a small model offered free
# whitespace can emit newlines until its budget runs out, and compact output stays short.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own estimate of one lexer state ("approx. 1-2 kB per state"), the upper one.
LEXER_STATE_BYTES = 2048
# How often a compile in a worker is checked against its bounds and its cancellation.
POLL_S = 0.01
_MIB = 2**20

# What a job's text is: a JSON schema, llguidance's own grammar text (Lark, as
# llguidance reads it), a llama.cpp GBNF grammar (converted to Lark: llguidance's
# converter, which passes Lark through), or a regular expression (the whole output).
JobKind = Literal["schema", "grammar", "gbnf", "regex"]


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot constrain decoding: invalid, using a feature
    the grammar engine does not implement or cannot enforce (the message names it), or past
    a bound of `GrammarConfig` (`GrammarLimitError`)."""


class GrammarLimitError(GrammarError):
    """A schema whose compile went past a bound: ``limit`` names it (``"timeout"``,
    ``"memory"``), ``bound`` is its value (seconds or bytes)."""

    def __init__(self, message: str, limit: str, bound: float) -> None:
        super().__init__(message)
        self.limit, self.bound = limit, bound


class GrammarBusy(RuntimeError):
    """No compile slot came free before the queue's deadline (``queue_timeout_s``)."""


class GrammarCancelled(RuntimeError):
    """The compile was cancelled (its client went away, or the compiler was closed)."""


@dataclass(frozen=True)
class GrammarConfig:
    """The bounds on compiling grammars from schemas a client sent.

    ``timeout_s``: wall seconds one compile may take in its worker (``--grammar-timeout``).
    ``max_bytes``: one grammar's memory (``--grammar-max-bytes``): its worker may grow by at
    most this while compiling, and what the grammar keeps, plus what its lexer may add as
    requests use it (``lexer_states`` states, a quarter of ``max_bytes``), must fit in it.
    ``cache_bytes``: the grammars arena of the memory plan, every grammar alive (cached or
    in use) counted (``--grammar-cache-bytes``). ``workers``: compiles at once
    (``--grammar-workers``). ``queue_timeout_s``: how long a compile may wait for a worker
    (``--grammar-queue-timeout``).
    """

    timeout_s: float = 10.0
    max_bytes: int = 32 * _MIB
    cache_bytes: int = 128 * _MIB
    workers: int = 1
    queue_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, flag in (("timeout_s", "timeout"), ("queue_timeout_s", "queue-timeout")):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"grammar {name}={value!r} must be a number of seconds > 0: "
                    f"pass e.g. --grammar-{flag} 10"
                )
        if self.max_bytes < 4 * _MIB:
            raise ValueError(
                f"grammar max_bytes={self.max_bytes} is below the least a grammar needs, "
                f"{4 * _MIB} (4 MiB): pass e.g. --grammar-max-bytes 32MiB"
            )
        if self.cache_bytes < self.max_bytes:
            raise ValueError(
                f"grammar cache_bytes={self.cache_bytes} is below max_bytes={self.max_bytes}: "
                "the cache must hold at least one grammar; raise --grammar-cache-bytes or "
                "lower --grammar-max-bytes"
            )
        if not isinstance(self.workers, int) or not 1 <= self.workers <= 64:
            raise ValueError(
                f"grammar workers={self.workers!r} must be an integer in 1..64: "
                "pass e.g. --grammar-workers 1"
            )

    @property
    def lexer_states(self) -> int:
        """The lexer states one grammar may build (llguidance's ``max_lexer_states``)."""
        return self.max_bytes // 4 // LEXER_STATE_BYTES

    @property
    def lexer_bytes(self) -> int:
        """The bytes those states may take: charged to every grammar up front."""
        return self.lexer_states * LEXER_STATE_BYTES

    def limits(self) -> dict[str, int]:
        """llguidance's `LLParserLimits` for grammars under this config."""
        return {"max_lexer_states": self.lexer_states}


def grammar_charge(kept: int, config: GrammarConfig) -> int:
    """What a grammar is charged in the plan: what it keeps once compiled (measured in its
    worker) and what its lexer may still add."""
    return kept + config.lexer_bytes


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


class CompileJob:
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
        self.future: concurrent.futures.Future[Grammar] = concurrent.futures.Future()
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

    def result(self, timeout: float | None = None) -> Grammar:
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


class CompilePool:
    """`GrammarConfig.workers` threads, each with one worker process, taking jobs in order
    from one queue. Daemon threads: nothing waits for them at exit, and the workers die
    with this process (PR_SET_PDEATHSIG). A worker builds its tokenizer index from
    ``source()``; a job proven within its bounds there is built here by ``finish(job,
    charge)`` (its grammar, charged ``charge`` bytes)."""

    def __init__(
        self,
        config: GrammarConfig,
        source: Callable[[], tuple[Any, int, list[int]]],
        finish: Callable[[CompileJob, int], Grammar],
    ) -> None:
        self.config = config
        self.source = source
        self.finish = finish
        self.jobs: queue.Queue[CompileJob | None] = queue.Queue()
        self.closed = threading.Event()
        self.workers: list[Worker | None] = [None] * self.config.workers
        self.running: list[CompileJob | None] = [None] * self.config.workers
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(
                target=self._run, args=(i,), name=f"slotserve-grammar-{i}", daemon=True
            )
            for i in range(self.config.workers)
        ]
        for thread in self.threads:
            thread.start()

    def put(self, job: CompileJob) -> None:
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

    def _compile(self, slot: int, job: CompileJob) -> Grammar:
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
                f"its grammar keeps {kept / _MIB:.1f} MiB, and with the "
                f"{config.lexer_bytes / _MIB:.0f} MiB its lexer may add that is more than "
                f"one grammar's share, --grammar-max-bytes {config.max_bytes / _MIB:.0f} MiB; "
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
            [sys.executable, "-I", "-c", WORKER_CODE],
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

    def compile(self, job: CompileJob, config: GrammarConfig) -> int:
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
                    f"{config.max_bytes / _MIB:.0f} MiB (stopped at {grown / _MIB:.0f} MiB after "
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


# The worker's program: its own interpreter (-I), importing llguidance alone. Frames are a
# little-endian u32 length and a pickle, both ways; the parent is the only peer.
WORKER_CODE = r"""
import ctypes, os, pickle, signal, struct, sys
try:
    os.nice(19)
except OSError:
    pass
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
except Exception:
    pass
read, write = sys.stdin.buffer, sys.stdout.buffer

def receive():
    head = read.read(4)
    if len(head) < 4:
        sys.exit(0)
    return pickle.loads(read.read(struct.unpack("<I", head)[0]))

def send(message):
    data = pickle.dumps(message)
    write.write(struct.pack("<I", len(data)) + data)
    write.flush()

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    ).split()]

def resident():  # anonymous bytes (RssAnon): the heap, not the libraries' code pages
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0

bare = resident()
try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    def in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
except Exception:
    in_use = resident

import llguidance

class Tokens:
    def __init__(self, source):
        self.tokens = source["tokens"]
        self.eos_token_id = source["eos_token_id"]
        self.bos_token_id = source["bos_token_id"]
        self.special_token_ids = source["special_token_ids"]
    def __call__(self, text):
        return []  # compiling never encodes text

source, n_vocab, eos = receive()
if isinstance(source, dict):
    source = llguidance.TokenizerWrapper(Tokens(source))
index = llguidance.LLTokenizer(source, n_vocab=n_vocab, eos_token=eos)
send(("ready", bare))
while True:
    kind, text, options, limits = receive()
    before = in_use()
    try:
        grammar = (
            llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
            if kind == "schema" else text
        )
    except ValueError as exc:
        send(("schema", str(exc)))
        continue
    try:
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import any_to_lark
            grammar = any_to_lark(text)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
    except (Exception, RecursionError) as exc:
        send(("convert", str(exc) or type(exc).__name__))
        continue
    matcher = llguidance.LLMatcher(
        index, grammar, log_level=0, limits=llguidance.LLParserLimits(**limits)
    )
    if matcher.is_error():
        send(("error", matcher.get_error()))
        continue
    start = matcher.deep_copy()
    bits = int.from_bytes(start.compute_bitmask(), "little")
    allowed = bin(bits).count("1") - sum(bits >> e & 1 for e in set(eos))
    if start.is_error() or allowed <= 0:
        send(("empty",))
        continue
    forced = start.compute_ff_tokens()
    if (forced and not start.consume_tokens(forced)) or start.is_error():
        send(("error", "the grammar engine cannot follow it past its first %d tokens (%s); "
              "simplify the schema (fewer properties or alternatives)"
              % (len(forced), start.get_error().strip().splitlines()[0])))
        continue
    del start
    send(("ok", max(in_use() - before, 0)))
    del matcher
"""
