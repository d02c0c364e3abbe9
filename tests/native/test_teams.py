"""Kernel calls outside the engine's thread leave no OpenMP team behind (native.threads).

A team started on a thread lives as long as the thread; with one on the main thread and one
on the engine's, libgomp manages more threads than the 2 cores and stops spinning between
regions, and the bundled model decoded at half speed (the load's first step did this). Each
check runs in a fresh process, on 2 cores, and counts the process's threads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = r"""
import os, sys, threading, time
import slotserve as ss
from slotserve.native import on_own_thread, one_thread
from slotserve.testing import write_tiny_gguf
from pathlib import Path

def threads():
    return len(os.listdir("/proc/self/task"))

path = write_tiny_gguf(Path(sys.argv[1]) / "tiny.gguf", "llama", "Q8_0")
model = ss.load(path, progress=False)  # runs its first step
before = threads()
assert model.kernels.blocks is not None and model.kernels.blocks.threads == 2
with one_thread(model.kernels):
    model.logits(list(range(40)))
after_one = threads()
on_own_thread(lambda: model.logits(list(range(40))))
# The thread's team ends as the thread does, just after join() returns: wait for it.
deadline = time.monotonic() + 10
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
after_own = threads()
model.logits(list(range(40)))  # all threads, on this thread: a team stays
after_main = threads()
print(before, after_one, after_own, after_main)
"""


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="a team needs 2 cores to have a worker"
)
def test_kernel_calls_off_the_engine_thread_leave_no_team(tmp_path: os.PathLike[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2]),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    before, after_one, after_own, after_main = map(int, done.stdout.split()[-4:])
    assert after_one == before  # the load and one_thread started no team here
    assert after_own == before  # the thread's team ended with it
    assert after_main == before + 1  # the probe itself: a team's worker stays
