"""The one thread policy of the kernels.

The kernels run on OpenMP threads, one per core this process may use. Loaded into a
process that has imported torch, their library binds to torch's own libgomp, so kernels and
torch share one set of worker threads. A block-weight step's own torch ops are tiny while
the kernels make ~150 parallel regions a step; with torch's threads as well, libgomp manages
more threads than there are cores and stops spinning between regions, so every region waits
for a sleeping thread to wake, which costs a large share of decode throughput
(docs/BENCHMARKS.md).
So `dedicate_cores_to_kernels` gives torch's own ops one thread; `slotserve.load` calls it
before it reads a file into kernel-backed weights, for the CLI, the benches and library users
alike. It must come before the process's first parallel torch op: that op starts an OpenMP
team on its thread that outlives it, and the engine thread's kernels then start a second
one, with the same effect.

The same holds for the kernels' own regions: one thread of the process runs them on all
cores, the engine's. A parallel region started on any other thread leaves a team there for
the life of the process, libgomp then manages more threads than there are cores and spins
only ~100 times before it sleeps (its "throttled" mode), and each of the engine's regions
waits for its worker to wake: a load that ran its first step on the main thread with all
threads slowed every later decode step. Kernel work outside an engine runs in
`on_own_thread` (`Model.logits` does, and so the load's first step), on a thread whose team
ends with it.

Torch's own heavy ops (an encoder's fp32 GEMMs) still want every core. They run in
`torch_on_cores`, on the engine thread that steps them, with torch on all cores for the
call only (the device scheduler runs one engine's step at a time, so they never share the
cores with a decode step's kernels), and the team they start there is ended after the
call (`release_team`), or, by an engine that steps again soon, once it goes idle or
another model's steps need the cores: a step of a few milliseconds cannot afford a thread
of its own, whose torch set-up costs more than the step.

Spinning assumes the cores are the process's own. When another process takes one, the
engine's `slotserve.native.contention.ThreadGovernor` drops the kernels to one thread until
it is free again.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

_log = logging.getLogger("slotserve")
T = TypeVar("T")
OMP_PAUSE_SOFT = 1  # OpenMP's omp_pause_soft


def process_cores() -> int:
    """The cores this process may run on: the kernels' thread count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def dedicate_cores_to_kernels() -> None:
    """Torch's own ops on one thread, so the kernels' OpenMP threads keep spinning between
    their parallel regions (see the module doc). Idempotent."""
    if torch.get_num_threads() != 1:
        _log.info(
            "block kernels: torch ops on 1 thread, kernels on %d (was torch %d)",
            process_cores(),
            torch.get_num_threads(),
        )
        torch.set_num_threads(1)


def on_own_thread(function: Callable[[], T]) -> T:
    """``function()`` on a thread of its own that ends with it, so whatever OpenMP team its
    kernel calls start on that thread ends too (see the module doc): for work that runs
    kernels on all cores outside an engine (a bench's in-process loop). Its exception, if
    any, is raised here."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(function())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="slotserve-kernels")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def torch_on_cores(
    function: Callable[[], T], threads: int | None = None, release: bool = True
) -> T:
    """``function()`` with torch's own ops on ``threads`` threads (None: the process's
    cores), on the calling thread; then torch's count is set back and, with ``release``,
    the OpenMP team the call started on this thread is ended (`release_team`), as a thread
    of its own would end it. For torch-heavy work in a process whose torch ops otherwise
    run on one thread (`dedicate_cores_to_kernels`): an encoder's step. Call it from one
    long-lived thread (an engine's), never from a thread per call: torch's per-thread
    set-up costs more than a small step. A caller that steps again soon passes
    ``release=False`` and ends the team itself when it goes idle, or when another model's
    steps need the cores (restarting the team on every small step would cost a share of
    each). One caller at a time: torch's count is process-wide. A call inside another runs
    ``function()`` as it is."""
    if getattr(_on_cores, "inside", False):  # nested: the outermost call sets and ends
        return function()
    wanted = threads or process_cores()
    before = torch.get_num_threads()
    if wanted != before:
        torch.set_num_threads(wanted)
    _on_cores.inside = True
    try:
        return function()
    finally:
        _on_cores.inside = False
        if wanted != before:
            torch.set_num_threads(before)
        if release:
            release_team()


_on_cores = threading.local()  # whether this thread is inside a `torch_on_cores` call


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The process's OpenMP runtime, the one torch loaded (and the kernels bind to), where
    it has OpenMP 5's ``omp_pause_resource_all``; else None."""
    try:
        runtime = ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None
    return runtime if hasattr(runtime, "omp_pause_resource_all") else None


def release_team() -> None:
    """End the OpenMP team the calling thread started (its worker threads), as the thread's
    own end would, so that it does not outlive the work that needed it (OpenMP 5's
    ``omp_pause_resource_all(omp_pause_soft)``; libgomp frees the calling thread's pool).
    A no-op where the runtime has no such call."""
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_pause_resource_all(OMP_PAUSE_SOFT)
