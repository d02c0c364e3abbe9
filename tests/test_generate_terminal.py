"""``slotserve generate`` on a terminal: the streamed answer is never interrupted by log
lines. Run as a user runs it (a child process, the bundled model) while busy loops hold
every core, so the kernels' contention notice fires: stdout holds exactly the greedy answer
of a run without the busy loops, stderr the notice at most once and no ExecuTorch stats
line; with both streams on one pipe, as a terminal shows them, the answer is one unbroken
piece, and ``--stats`` puts the stats line after it."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from slotserve.cli.log_gate import LogGate

ARGV = [
    *(sys.executable, "-m", "slotserve.cli", "generate", "The capital of France is"),
    *("--temperature", "0", "--max-new-tokens", "16"),
]
NOTICE = "another process holds the cores"
STATS = "PyTorchObserver"


def generate(*extra: str, merged: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ARGV, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        timeout=300,
        check=True,
    )


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """One spinning process per core, for the test's duration."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@pytest.fixture(scope="module")
def answer() -> str:
    """The greedy answer, with no busy loop beside it."""
    text = generate().stdout
    assert text.startswith(" Paris.")
    return text


def test_stdout_holds_only_the_answer_under_contention(answer: str, busy_cores: None) -> None:
    run = generate()
    assert run.stdout == answer
    assert run.stderr.count(NOTICE) <= 1, run.stderr
    assert STATS not in run.stderr


def test_one_pipe_shows_the_answer_unbroken_and_stats_after_it(
    answer: str, busy_cores: None
) -> None:
    screen = generate("--stats", merged=True).stdout
    assert answer in screen, screen
    assert screen.count(NOTICE) <= 1, screen
    assert screen.count(STATS) == 1
    assert screen.index(STATS) > screen.index(answer)


def test_the_gate_holds_records_while_streaming_and_writes_each_message_once() -> None:
    """In process: records logged (from another thread too) while the gate holds wait
    until the body ends, in order; a repeated message is written once; the root's
    handlers are back afterwards."""
    root, log = logging.getLogger(), logging.getLogger("slotserve.test-gate")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved, root.handlers = root.handlers, [handler]
    log.setLevel(logging.INFO)
    try:
        with LogGate() as gate:
            log.info("loading")
            with gate.holding():
                thread = threading.Thread(target=log.info, args=("busy: %d%%", 40))
                thread.start()
                thread.join()
                log.info("busy: %d%%", 30)  # the same message again: not written
                log.warning("late")
                assert stream.getvalue() == "loading\n"
            assert root.handlers == [gate]
        assert root.handlers == [handler]
    finally:
        root.handlers = saved
    assert stream.getvalue() == "loading\nbusy: 40%\nlate\n"
