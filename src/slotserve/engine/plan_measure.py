"""The memory plan measured: each arena's bytes as the process really holds them, in
anonymous bytes (`slotserve.memory.process`).

`measure_arenas` allocates what the plan computes and reads the anonymous bytes around
each: the KV pool allocated and every page written (as sessions at ``max_context`` would),
and the activations as the peak growth of the largest step the config allows
(`slotserve.engine.probe.largest_step`, run on that pool with every session at its
longest). The ledger's measured arenas (the runtime, the tokenizer, the weights, a
bundle's methods) are what the load and the probes measured. `slotserve plan --measure`
prints it beside the plan; tests compare the two. It allocates a pool of its own: call it
where one more pool fits, never inside a running engine's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.engine.cancel_bound import CancelBound, declare_cancel_bound
from slotserve.engine.config import EngineConfig
from slotserve.engine.probe import largest_step
from slotserve.executor import Executor, executor_for
from slotserve.kv.pool import KVPool
from slotserve.memory import MemoryLedger, anonymous_bytes, trim_heap
from slotserve.model import Model


@dataclass(frozen=True)
class MeasuredArenas:
    """Measured bytes by arena (``arenas``: the names the plan uses, those measured) and
    the largest step's time (a measured `CancelBound`)."""

    arenas: dict[str, int]
    cancel_bound: CancelBound


def measure_arenas(
    model: Model,
    config: EngineConfig,
    executor: Executor | None = None,
    ledger: MemoryLedger | None = None,
) -> MeasuredArenas:
    """Measure ``config``'s arenas on ``model`` (see the module docstring); ``ledger``
    (default the model's) gives the measured ones."""
    executor = executor or executor_for(model)
    ledger = ledger if ledger is not None else model.ledger
    arenas: dict[str, int] = {}
    for arena in ledger.entries if ledger is not None else ():
        if arena.how == "measured":
            arenas[arena.name] = arenas.get(arena.name, 0) + arena.bytes
    model.cover_positions(config.max_context)  # planned apart from the step's transient
    trim_heap()
    before = anonymous_bytes()
    # The pool the engine builds: attending with the compiled kernel where the config runs
    # it (torch's attention is a path the engine never runs).
    attention = model.kernels.attention if config.kernels == "auto" else None
    pool = KVPool(model.info, config.kv_config(), attention)
    for group in pool.groups:
        for storage in (*group.keys.values(), *group.values.values()):
            storage.data.fill_(1)  # every page resident, as at the worst case
    arenas["kv"] = anonymous_bytes() - before
    tokens, seconds = largest_step(model, config, executor, pool)
    arenas["activations"] = seconds[1]
    bound = declare_cancel_bound(tokens, {tokens: [seconds[0]]}, [])
    return MeasuredArenas(arenas, bound)
