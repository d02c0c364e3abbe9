"""The memory plan measured: each arena's bytes as the process really holds them.

`measure_arenas` allocates what the plan counts and reads the resident set around each: the runtime,
the tokenizer and the weights as `slotserve.load` measured them (`Model.load_memory`), the KV pool
allocated and every page written (as sessions at ``max_context`` would), and the activations as the
peak growth of the largest step the config allows (`largest_step_tokens`, run on that pool with
every session at its longest). `slotserve plan --measure` prints it beside the plan; tests compare
the two. It allocates a pool of its own: call it where one more pool fits, never inside a running
engine's budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from slotserve.engine.cancel_bound import CancelBound, declare_cancel_bound, largest_step_tokens
from slotserve.engine.config import EngineConfig
from slotserve.executor import Executor, executor_for
from slotserve.kv.batch import StepBatch
from slotserve.kv.pool import KVPool
from slotserve.memory import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap
from slotserve.model import Model
from slotserve.sampling import COSTLIEST_SAMPLING, RequestSampler, sample_batch, token_logprobs


@dataclass(frozen=True)
class MeasuredArenas:
    """Measured bytes by arena (``arenas``: the names the plan uses, those measured) and
    the largest step's time (a measured `CancelBound`)."""

    arenas: dict[str, int]
    cancel_bound: CancelBound


def measure_arenas(
    model: Model, config: EngineConfig, executor: Executor | None = None
) -> MeasuredArenas:
    """Measure ``config``'s arenas on ``model`` (see the module docstring)."""
    executor = executor or executor_for(model)
    arenas: dict[str, int] = {}
    if model.load_memory is not None:
        arenas["runtime"] = model.load_memory.runtime_arena_bytes
        if model.load_memory.tokenizer_bytes:
            arenas["tokenizer"] = model.load_memory.tokenizer_bytes
        arenas["weights"] = model.load_memory.growth_bytes
        if model.load_memory.method_bytes:
            arenas["methods"] = model.load_memory.method_bytes
    trim_heap()
    before = rss_bytes()
    # The pool the engine builds: attending with the compiled kernel where the config runs
    # it. Without it the step attended with torch's SDPA, a path the engine never runs: it
    # first faulted in 12 MiB of libtorch's code, measured as activations (a Xeon's largest
    # step measured 31-35 MB against a plan of 30.0 MB, 10-11 MB on the kernel).
    attention = model.kernels.attention if config.kernels == "auto" else None
    pool = KVPool(model.info, config.kv_config(), attention)
    for group in pool.groups:
        for storage in (*group.keys.values(), *group.values.values()):
            storage.data.fill_(1)  # every page resident, as at the worst case
    arenas["kv"] = rss_bytes() - before
    tokens, seconds = largest_step(model, config, executor, pool)
    arenas["activations"] = seconds[1]
    bound = declare_cancel_bound(tokens, {tokens: [seconds[0]]}, [])
    return MeasuredArenas(arenas, bound)


def largest_step(
    model: Model, config: EngineConfig, executor: Executor, pool: KVPool
) -> tuple[int, tuple[float, int]]:
    """Run the largest step on ``pool``, which holds no session: one prefill chunk per
    session (of ``max_seqs``, ids 0 up) ending at ``max_context``, within
    ``max_batch_tokens``; the sessions stay reserved (the caller releases them). Returns its
    tokens, and its time with the peak resident growth it caused. `KVExhausted` when the
    pool cannot hold every session at ``max_context`` (a cell pool given fewer blocks)."""
    tokens = largest_step_tokens(config)
    if executor.max_step_tokens is not None:
        tokens = min(tokens, executor.max_step_tokens)
    seqs = min(config.max_seqs, tokens)
    chunk = min(tokens // seqs, config.max_context)
    ids = [model.info.bos_id or 1] * (chunk * seqs)
    for seq in range(seqs):  # every session at its longest: the step attends the most
        pool.reserve(seq, config.max_context)
        prefix = config.max_context - chunk
        if prefix:
            pool.begin_step(StepBatch(sessions=[seq], starts=[0], lengths=[prefix]))
    batch = StepBatch(
        sessions=list(range(seqs)),
        starts=[config.max_context - chunk] * seqs,
        lengths=[chunk] * seqs,
    )
    pool.begin_step(batch)
    trim_heap()
    reset_peak_rss()
    before = rss_bytes()
    began = time.perf_counter()
    # A step is its forward and its sampling, for live requests holding their samplers'
    # state: each row drawn as the costliest settings draw it.
    vocab = model.info.vocab_size
    samplers = [RequestSampler(COSTLIEST_SAMPLING, vocab, ids[:chunk]) for _ in range(seqs)]
    with torch.inference_mode():
        logits = executor.step(torch.tensor(ids), batch, pool)
        for row, token in zip(logits, sample_batch(logits, samplers), strict=True):
            token_logprobs(row, token, COSTLIEST_SAMPLING.logprobs or 0)
    elapsed = time.perf_counter() - began
    return chunk * seqs, (elapsed, max(peak_rss_bytes() - before, 0))
