"""A process that ends while an engine request runs exits normally, with its own status.

The engine thread runs torch kernels; an interpreter that finalises under it used to abort
(``terminate called without an active exception``, status 134). Each case runs a real
script on the bundled model in a subprocess, exits mid-generation, and checks the status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

MID_GENERATION = """
import time, slotserve as ss
engine = ss.Engine(ss.load("bundled", progress=False), ss.EngineConfig(max_seqs=1, max_context=512))
events = iter(engine.submit("Hi", ss.SamplingParams(max_new_tokens=400, ignore_eos=True)))
next(events)
time.sleep(0.5)
"""

ENDINGS = {
    "sys.exit": ("raise SystemExit(3)", 3),
    "uncaught exception": ("raise RuntimeError('the script failed')", 1),
    "end of script": ("", 0),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_exit_mid_request_keeps_the_status(ending: str) -> None:
    code, expected = ENDINGS[ending]
    done = subprocess.run(
        [sys.executable, "-c", MID_GENERATION + code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == expected, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def _as_at_a_terminal() -> None:
    """The child's SIGINT as a terminal's shell leaves it (default), whatever this process
    inherited: a non-interactive shell that backgrounds a command ignores SIGINT for it, and
    Python then installs no KeyboardInterrupt handler in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_generate_exits_130() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "generate",
            "Write a long story about a lighthouse keeper.",
            "--chat",
            "--max-new-tokens",
            "400",
            "--temperature",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_at_a_terminal,
    )
    assert process.stdout is not None
    process.stdout.read(1)  # the first streamed character: generation is under way
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-2000:]
    assert "terminate called" not in stderr
