"""The grammar compiler's tokenizer index, measured when a server starts: the
``grammar_index`` arena of the memory plan.

llguidance's view of the tokenizer (`GrammarCompiler`: ~60 MiB resident on the bundled
model's 49k vocabulary) and the first compile's one-time costs in this process (the worker
fed the tokenizer, the library's own state) are paid once per compiler, by whatever
request comes first; left to it, they are in no arena. `prepare` pays them before the
engine's plan is checked, the way a first structured request would, measures the resident
growth they caused, which the plan then reserves, and releases them: the first structured
request builds them again (~0.5 s, once), and a server that never gets one never holds them.
"""

from __future__ import annotations

import logging
from typing import Any

from slotserve.memory import rss_bytes, trim_heap
from slotserve.sampling.grammar import GrammarBusy, GrammarCompiler, GrammarError

log = logging.getLogger("slotserve")

# The least schema that takes the whole path of a client's schema: an object of one integer.
WARM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


def prepare(compiler: GrammarCompiler) -> int:
    """Build ``compiler``'s tokenizer index and take its first compile through the bounded
    pool (`GrammarCompiler.submit`, as a client's schema goes: the worker started and
    fed the tokenizer, the grammar compiled again here, then dropped); return the bytes
    the process's resident set grew by, the ``grammar_index`` arena, after releasing
    what was built (`GrammarCompiler.release`). Where the pool cannot compile (its worker
    does not start), the index is built here alone and that is measured; the structured
    requests then report the worker's failure themselves."""
    before = rss_bytes()
    try:
        compiler.submit(WARM_SCHEMA).result()  # within the config's queue and compile bounds
    except (GrammarError, GrammarBusy) as exc:
        log.warning("grammar worker warm-up failed (%s); building the index here alone", exc)
        compiler.json_schema(WARM_SCHEMA)
    grown = max(rss_bytes() - before, 0)
    compiler.release()
    trim_heap()
    return grown
