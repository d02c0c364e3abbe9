"""Kernel work outside the engine's thread leaves no OpenMP team behind (native.threads).

A team started on a thread lives as long as the thread; with one on the main thread and one
on the engine's, libgomp manages more threads than the 2 cores and stops spinning between
regions, and the bundled model decoded at half speed (the load's first step did this, on
the main thread). The check runs in a fresh process on 2 cores and counts its threads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Both probes count their process's threads, and wait for a thread's team to end (it ends
# as the thread does, just after join() returns).
COUNTING = r"""
import os, time

def threads():
    return len(os.listdir("/proc/self/task"))

def settled(before):
    deadline = time.monotonic() + 10
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
"""

PROBE = (
    COUNTING
    + r"""
import os, sys, time
import torch
import slotserve as ss
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native import on_own_thread
from slotserve.testing import write_tiny_gguf
from slotserve.engine.probe import teacher_forced_logits
from pathlib import Path


def stable():
    # The count once the threads the load's first step started have ended (they end just
    # after their join returns: on a loaded machine, a while after): the same for 0.5 s.
    count, same, deadline = threads(), 0, time.monotonic() + 10
    while same < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
        now = threads()
        same, count = (same + 1, count) if now == count else (0, now)
    return count

path = write_tiny_gguf(Path(sys.argv[1]) / "tiny.gguf", "llama", "Q8_0")
model = ss.load(path, progress=False)
before = stable()
assert model.kernels.blocks is not None and model.kernels.blocks.threads == 2
on_own_thread(lambda: teacher_forced_logits(model, list(range(40))))
after_own = settled(before)
teacher_forced_logits(model, list(range(40)))  # the README's call, on the main thread
after_logits = settled(before)
# A forward with all threads on this thread, as logits() ran before: a team stays.
config = KVConfig(layout="flat", max_seqs=1, max_context=40)
kv = KVPool(model.info, config, model.kernels.attention)
kv.reserve(0, 40)
batch = StepBatch.single(0, 40)
kv.begin_step(batch)
model.forward(torch.arange(40), batch, kv)
print(before, after_own, after_logits, threads())
"""
)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="a team needs 2 cores to have a worker"
)
def test_kernel_work_off_the_engine_thread_leaves_no_team(tmp_path: os.PathLike[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, after_own, after_logits, after_main = map(int, done.stdout.split()[-4:])
    assert after_own == before  # on_own_thread's team ended with its thread
    assert after_logits == before  # teacher_forced_logits left none
    assert after_main == before + 1  # the probe itself: a forward here leaves a worker


# An encoder's torch-heavy step in a process whose torch ops run on one thread: torch is on
# every core for the call and on one after, and the team the call started on its (long-
# lived) thread ends with the call.
TORCH_PROBE = (
    COUNTING
    + r"""
import os, threading, time
import torch
from slotserve.native import dedicate_cores_to_kernels, torch_on_cores

dedicate_cores_to_kernels()
a, w = torch.randn(171, 384), torch.randn(1536, 384)


def step():
    torch.nn.functional.linear(a, w)
    return torch.get_num_threads(), threads()

seen = []
def engine_thread():
    before = threads()
    inside, during = torch_on_cores(step)
    seen.extend([before, during, settled(before), inside, torch.get_num_threads()])
    torch.set_num_threads(2)  # without torch_on_cores's end: the team stays
    torch.nn.functional.linear(a, w)
    torch.set_num_threads(1)
    time.sleep(0.2)
    seen.append(threads())

thread = threading.Thread(target=engine_thread)
thread.start()
thread.join()
print(*seen)
"""
)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="a team needs 2 cores to have a worker"
)
def test_torch_on_cores_uses_every_core_and_leaves_no_team() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, during, after, inside, outside, kept = map(int, done.stdout.split()[-6:])
    assert (inside, outside) == (2, 1)
    assert during == before + 1  # the call's team: one worker beside the thread
    assert after == before  # ended with the call
    assert kept == before + 1  # the probe itself: a team started without it stays
