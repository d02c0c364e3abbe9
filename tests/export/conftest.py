"""Export fixtures: the bundled model's fp32 bundle, exported in a background process.

Exporting the bundled model is the suite's longest setup (about three minutes of one core),
and an export is one Python thread: run in the test process it leaves the second core idle.
So it starts, in a child process at low priority, with the first test of this directory
(when the session will need it), and runs beside this directory's other exports, which are
as single-threaded and timing-free; `BackgroundExport.result` waits for it. The child runs
what the fixture ran in-process before: `export_bundle` of ``ss.load("bundled",
weights="fp32")`` with the same options.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

BUNDLED_FP32 = {"quant": "fp32", "max_tokens": 128, "max_context": 256}

SCRIPT = f"""
import os, sys
os.nice(10)  # the tests in this process keep the priority
from pathlib import Path
import slotserve as ss
from slotserve.export import ExportOptions, export_bundle
model = ss.load("bundled", weights="fp32", progress=False)
export_bundle(model, Path(sys.argv[1]), ExportOptions(**{BUNDLED_FP32!r}))
"""


class BackgroundExport:
    """``export_bundle`` of the bundled model into ``out``, in a child process."""

    def __init__(self, out: Path) -> None:
        self.out = out
        # Output goes to a file: a pipe nobody reads would block the child once full.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="export-", suffix=".log")  # noqa: SIM115 (lives as long as the child)
        self.process = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(out)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def result(self, timeout_s: float = 1800) -> Path:
        """The bundle's directory, once the child has written it (its output if it failed)."""
        status = self.process.wait(timeout_s)
        if status != 0:
            self.log.flush()
            raise RuntimeError(f"the export exited {status}:\n{Path(self.log.name).read_text()}")
        return self.out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def bundled_fp32_export(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundExport]:
    export = BackgroundExport(tmp_path_factory.mktemp("bundled") / "smollm2-fp32")
    yield export
    export.stop()


@pytest.fixture(scope="session", autouse=True)
def _start_the_bundled_export_early(request: pytest.FixtureRequest) -> None:
    """Starts `bundled_fp32_export` with this directory's first test, if a test needs it."""
    needed = (getattr(item, "fixturenames", ()) for item in request.session.items)
    if any("bundled_fp32_export" in names for names in needed):
        request.getfixturevalue("bundled_fp32_export")
