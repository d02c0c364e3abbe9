"""``slotserve serve`` imports only what serving needs (issue 27): not ExecuTorch,
transformers, matplotlib or playwright, nor llguidance before a structured request needs it
(the grammar index is measured in a worker), in a fresh interpreter that runs the serve command
on the bundled model (model load, plan, engine, grammar setup) and a request through its
engine; only the HTTP server itself is replaced."""

from __future__ import annotations

import json
import subprocess
import sys

NOT_FOR_SERVING = ("executorch", "transformers", "matplotlib", "playwright", "llguidance")

SCRIPT = f"""
import json, sys
import slotserve as ss
import slotserve.server

def serve(engine, *args, **kwargs):
    handle = engine.submit("Hello", ss.SamplingParams(temperature=0, max_new_tokens=4))
    handle.result()
    heavy = {NOT_FOR_SERVING!r}
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
    return 0

slotserve.server.serve = serve
from slotserve.cli import main
sys.exit(main(["serve", "--model", "bundled", "--max-seqs", "2", "--max-context", "512"]))
"""


def test_serve_imports_only_what_serving_needs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
