"""The grammar compiler's tokenizer index, measured when a server starts: the
``grammar_index`` arena of the memory plan.

llguidance's view of the tokenizer (`GrammarCompiler`), the library itself and the first
compile's one-time costs are paid once per compiler, in the server's process, by whatever
structured request comes first; left to it, they are in no arena. `prepare` measures them
before the engine's plan is checked, and the plan reserves them. It measures them in a
grammar worker process (the compile pool's `Worker`, a bare interpreter that imports
llguidance alone), which builds the same index from the same source and takes the same first
compile: the server's process imports nothing of llguidance until a request needs it, and a
server that never gets a structured request never holds any of it.

What the worker measures is its anonymous peak's growth (its resident peak less the file
pages of llguidance's code), to which the server adds the source it pickles for its own
first worker (held twice while it is sent: the text and its pickle).

The workers are memory of the device too: each of ``--grammar-workers`` is a process of its
own that holds its interpreter, llguidance and an index of its own for as long as the server
runs. The warm-up's worker is one of them, so its whole anonymous peak is what each costs
(the ``grammar_workers`` arena: `GrammarCost`).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from typing import Any

from slotserve.memory import anonymous_bytes, read_process, trim_heap
from slotserve.sampling.compile_pool import CompileJob, Worker
from slotserve.sampling.grammar import (
    Grammar,
    GrammarBusy,
    GrammarCompiler,
    GrammarError,
    schema_text,
)

log = logging.getLogger("slotserve")

# The least schema that takes the whole path of a client's schema: an object of one integer.
WARM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class GrammarCost:
    """What compiling grammars costs the device, measured at a server's start (`prepare`):
    ``index_bytes`` in the server's own process (the ``grammar_index`` arena) and
    ``worker_bytes`` in each of its ``workers`` compile processes, whole (the
    ``grammar_workers`` arena: `workers_bytes`; 0 where no worker started)."""

    index_bytes: int
    worker_bytes: int
    workers: int

    @property
    def workers_bytes(self) -> int:
        return self.worker_bytes * self.workers


def prepare(compiler: GrammarCompiler) -> GrammarCost:
    """What compiling with ``compiler`` costs (`GrammarCost`). The index: the bytes a
    worker process's resident
    set peaked above where it stood before it imported llguidance, by the time it had built
    the tokenizer index and compiled `WARM_SCHEMA` within the config's bounds, as this
    process will when its first structured request comes, and twice the pickled source
    (see the module docstring); a worker: that worker's whole anonymous peak. Where no
    worker starts or compiles, the index is built here instead, measured, and released
    (`GrammarCompiler.release`), and no worker is counted; the structured requests then
    report the worker's failure themselves."""
    workers = compiler.config.workers
    source = compiler.worker_source()
    try:
        worker = Worker(source)
    except (GrammarError, OSError) as exc:
        log.warning("grammar worker did not start (%s); measuring the index here", exc)
        return GrammarCost(_measure_here(compiler), 0, workers)
    try:
        job = CompileJob[Grammar](schema_text(WARM_SCHEMA), compiler.config.queue_timeout_s)
        worker.compile(job, compiler.config)
        # The resident peak less the file pages now (llguidance's code, mapped before the
        # index was built): the anonymous peak, above the worker's anonymous bytes before.
        now = read_process(worker.process.pid)
        peak = max(now.peak - now.file - now.shared, now.anonymous)
        grown = max(peak - worker.bare_anonymous, 0)
        return GrammarCost(grown + 2 * len(pickle.dumps(source)), peak, workers)
    except (GrammarError, OSError) as exc:
        log.warning("grammar worker warm-up failed (%s); measuring the index here", exc)
        return GrammarCost(_measure_here(compiler), 0, workers)
    finally:
        worker.dispose()


def _measure_here(compiler: GrammarCompiler) -> int:
    """The index built and a first compile taken in this process: its anonymous growth,
    after which both are released."""
    before = anonymous_bytes()
    try:
        compiler.json_schema(WARM_SCHEMA)
    except (GrammarError, GrammarBusy) as exc:
        log.warning("the index could not be built (%s); the plan reserves none", exc)
    grown = max(anonymous_bytes() - before, 0)
    compiler.release()
    trim_heap()
    return grown
