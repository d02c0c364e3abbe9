"""The suite's bundles, exported in child processes beside the tests (`ExportFarm`).

An export is one Python thread inside ExecuTorch's lowering for tens of seconds (the tiny
models) to minutes (the bundled model), and the suite needs six of them. Run in the test
process they were a quarter of its time, with the second core idle. So the session submits
every export its tests will need when the first test starts, the farm runs them one child
at a time, and the modules that use them run last (`tests/conftest.py`);
a fixture's `ExportFarm.result` waits for its bundle. Each child runs what the fixture ran
in-process before: load the model, `export_bundle` it.

The child runs at the tests' own priority: at a lower one, two test workers on two cores
starve it, and the modules that read its bundles end the run waiting for it.

Under pytest-xdist (`make test` runs two workers) every worker sees the whole session, but
only one of them, the farm's owner, runs the exports; the others read the bundles from the
same directory once the owner has marked each one done (``NAME.done``: empty, or the failed
child's output). The owner's session then waits for its exports instead of killing them at
its end, since a test on another worker may still need one.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from slotserve.testing import random_state_dict, tiny_config, write_tiny_hf_dir

BUNDLED_FP32: dict[str, Any] = {"quant": "fp32", "max_tokens": 128, "max_context": 256}

# The tied-embedding model: a tiny random Llama whose tied embedding (32768 x 256) is large
# enough to dominate its weights, so that a second copy shows in the file and in the RSS.
TIED_VOCAB, TIED_DIM = 32768, 256

CHILD = """
import json, os, sys
from pathlib import Path
import slotserve as ss
from slotserve.export import ExportOptions, export_bundle, load_for_export
job = json.loads(sys.argv[1])
if job["blocks"]:
    model = load_for_export(job["source"], progress=False)
else:
    model = ss.load(job["source"], progress=False, **job["load"])
export_bundle(model, Path(sys.argv[2]), ExportOptions(**job["options"]))
"""


@dataclass(frozen=True)
class Export:
    """One bundle: ``source`` loaded (its GGUF blocks kept, as `slotserve export` loads a
    GGUF, when ``blocks``; else `ss.load` with ``load``), exported with ``options``."""

    source: Path | str
    options: dict[str, Any]
    blocks: bool = False
    load: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        fields = {"source": str(self.source), "options": self.options}
        return json.dumps({**fields, "blocks": self.blocks, "load": self.load})


class ExportFarm:
    """Runs submitted exports one at a time, in submission order, each in a child process;
    ``result`` waits for one. ``owner`` False: a farm that runs nothing and waits for the
    bundles another process's farm (its owner, on the same ``root``) writes and marks done;
    ``shared`` (an owner that others read from): `stop` lets the exports finish."""

    def __init__(self, root: Path, *, owner: bool = True, shared: bool = False) -> None:
        self.root = root
        self.owner, self.shared = owner, shared
        self._exports: dict[str, Export] = {}
        self._done: dict[str, threading.Event] = {}
        self._failures: dict[str, str] = {}
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._child: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._runner = threading.Thread(target=self._run, name="export-farm", daemon=True)
        if owner:
            self._runner.start()

    def submit(self, name: str, export: Export) -> None:
        assert name not in self._exports, f"{name} was submitted twice"
        self._exports[name] = export
        self._done[name] = threading.Event()
        if self.owner:
            self._queue.put(name)

    def submitted(self) -> None:
        """Every export is submitted (an owner marks it: its inputs are written)."""
        if self.owner:
            (self.root / "submitted").touch()

    def source(self, name: str, timeout_s: float = 600) -> Path | str:
        """What export ``name`` is made from; another process's farm's once it has
        written its inputs."""
        deadline = time.monotonic() + timeout_s
        while not self.owner and not (self.root / "submitted").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the farm's owner did not submit in {timeout_s:.0f} s")
            time.sleep(0.2)
        return self._exports[name].source

    def result(self, name: str, timeout_s: float = 1800) -> Path:
        """The bundle's directory once its child has written it (the child's output if it
        failed). A name nobody submitted is a test asking for an export the session did not
        see it needs: `tests/conftest.py` names each fixture's exports."""
        if name not in self._done:
            raise KeyError(f"the export {name!r} was not submitted (see tests/conftest.py)")
        if not self.owner:
            return self._owners_result(name, timeout_s)
        if not self._done[name].wait(timeout_s):
            raise TimeoutError(f"the export {name!r} took over {timeout_s:.0f} s")
        if name in self._failures:
            raise RuntimeError(f"the export {name!r} failed:\n{self._failures[name]}")
        return self.root / name

    def _owners_result(self, name: str, timeout_s: float) -> Path:
        marker = self.root / f"{name}.done"
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the export {name!r} took over {timeout_s:.0f} s")
            time.sleep(0.2)
        if failure := marker.read_text():
            raise RuntimeError(f"the export {name!r} failed:\n{failure}")
        return self.root / name

    def stop(self, timeout_s: float = 1800) -> None:
        """Kills the running child and runs nothing more; a shared owner first lets every
        submitted export finish (another worker's test may still wait for one)."""
        if not self.owner:
            return
        if self.shared:
            self._queue.put(None)  # after the exports already queued
            self._runner.join(timeout=timeout_s)
        self._stopping = True
        self._queue.put(None)
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()
        self._runner.join(timeout=60)

    def _run(self) -> None:
        while (name := self._queue.get()) is not None and not self._stopping:
            # Output goes to a file: a pipe nobody reads would block the child once full.
            with tempfile.TemporaryFile("w+") as log:
                self._child = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        CHILD,
                        self._exports[name].to_json(),
                        str(self.root / name),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
                if self._child.wait() != 0:
                    log.seek(0)
                    self._failures[name] = f"exit {self._child.returncode}\n{log.read()}"
            # Written whole, then renamed: a reader never sees half a marker.
            partial = self.root / f"{name}.done.tmp"
            partial.write_text(self._failures.get(name, ""))
            partial.replace(self.root / f"{name}.done")
            self._done[name].set()


def write_tied_llama(directory: Path) -> Path:
    """The tied-embedding model's safetensors directory (2 layers, seed 0)."""
    path = write_tiny_hf_dir(directory, "llama")
    config = {
        **tiny_config("llama"),
        "tie_word_embeddings": True,
        "vocab_size": TIED_VOCAB,
        "hidden_size": TIED_DIM,
        "intermediate_size": 2 * TIED_DIM,
        "num_hidden_layers": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_state_dict(config, 0), str(path / "model.safetensors"))
    return path
