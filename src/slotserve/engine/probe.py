"""The probe: the one place that runs a model's step outside an engine's serving loop, on a
scratch pool or on an idle engine's own, to learn what the plan and the declared bounds
need.

- `teacher_forced_logits`: a sequence's logits from an empty context (tests, parity).
- `first_step`: one token and the costliest draw, so the one-time state a first step
  leaves (thread pools, lazily built tables, the math libraries' set-up) is measured into
  the ``runtime`` arena instead of landing on whichever request runs first.
- `bundle_largest_step`: a bundle's largest step, whose planned arenas and delegate scratch
  stay resident (the ``methods`` arena).
- `largest_step`: the largest step a config allows, on a given pool (the cancellation
  bound's time, the activations' peak).
- `measure_cancel_bound`: that step's time on a scratch pool, before serving.
- `ledger_for`: the ledger an engine plans with, filled by the load and by these probes.
"""

from __future__ import annotations

import time

import torch

from slotserve.engine.cancel_bound import CancelBound, declare_cancel_bound, largest_step_tokens
from slotserve.engine.config import EngineConfig
from slotserve.errors import KVExhausted
from slotserve.executor import Executor
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import DEFAULT_KV_DTYPE, KVConfig
from slotserve.kv.pool import KVPool
from slotserve.memory import MemoryLedger, read_process, reset_peak, trim_heap
from slotserve.model import Model
from slotserve.native.threads import on_own_thread
from slotserve.sampling import COSTLIEST_SAMPLING, RequestSampler, sample_batch, token_logprobs

FIRST_STEP = "first step"
BUNDLE_LARGEST_STEP = "a bundle's largest step"


def teacher_forced_logits(
    model: Model, token_ids: list[int], *, kv_dtype: str = DEFAULT_KV_DTYPE
) -> torch.Tensor:
    """Logits ``[T, vocab]`` of ``token_ids`` from an empty context (entry i scores the
    token after ``token_ids[: i + 1]``), with the KV stored as ``kv_dtype`` (the engine's
    default unless given; ``"fp32"`` to compare with an fp32 reference). Runs on a thread
    of its own that ends with the call: the kernels' OpenMP team it starts ends too, so a
    caller's thread (the main thread, before it starts an `Engine`) keeps none to throttle
    the engine's (`slotserve.native.threads`)."""
    if not token_ids:
        raise ValueError("teacher_forced_logits() needs at least one token")
    config = KVConfig(layout="flat", max_seqs=1, max_context=len(token_ids), dtype=kv_dtype)
    kv = KVPool(model.info, config, attention=model.kernels.attention)
    kv.reserve(0, len(token_ids))
    batch = StepBatch.single(0, len(token_ids))
    kv.begin_step(batch)
    tokens = torch.tensor(token_ids)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def forward() -> torch.Tensor:  # in the caller's autograd modes (thread-local)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return model.forward(tokens, batch, kv, all_logits=True)

    return on_own_thread(forward)


def first_step(model: Model) -> None:
    """One token through ``model`` and a draw from its logits as the costliest sampling
    draws (`COSTLIEST_SAMPLING`), leaving only its one-time state behind."""
    first = model.info.bos_id or 0
    sampler = RequestSampler(COSTLIEST_SAMPLING, model.info.vocab_size, [first])
    with torch.inference_mode():
        (row,) = teacher_forced_logits(model, [first])
        token_logprobs(row, sampler.sample(row), COSTLIEST_SAMPLING.logprobs or 0)


def bundle_largest_step(model: Model) -> None:
    """For a bundle, the largest step its methods take (``max_step_tokens`` rows, in as few
    sequences as its context allows) on a scratch pool; nothing for halves that are not a
    program. The pool and the activations are gone when it returns; the methods' planned
    arenas and the delegates' scratch for its rows stay."""
    rows = model.halves.max_step_tokens
    if model.halves.kind != "program" or not rows:
        return
    context = min(rows, model.info.max_context)  # as many sequences as the rows need
    lengths = [context] * (rows // context) + ([rows % context] if rows % context else [])

    def step() -> None:
        config = KVConfig(layout="flat", max_seqs=len(lengths), max_context=context)
        kv = KVPool(model.info, config, attention=model.kernels.attention)
        for session, length in enumerate(lengths):
            kv.reserve(session, length)
        batch = StepBatch(list(range(len(lengths))), [0] * len(lengths), lengths)
        kv.begin_step(batch)
        with torch.inference_mode():
            model.forward(torch.full((rows,), model.info.bos_id or 0), batch, kv)

    on_own_thread(step)  # no kernel team left on this thread


def ledger_for(
    model: Model, config: EngineConfig, executor: Executor, ledger: MemoryLedger | None = None
) -> MemoryLedger:
    """The ledger an engine of ``config`` on ``model`` plans with (``ledger``: default
    `command_ledger`'s), its model's arenas in it.

    ``budget_scope="model"``: the model's own arenas, computed: the weights at the
    executor's bytes and a bundle's planned method arenas (a program that embeds the engine
    budgets the rest of its process itself). ``"process"``: what `slotserve.load` measured
    (the runtime before the model, the tokenizer, the weights, the load's peak), to which
    the probes add, once a ledger, the first step's one-time state (``runtime``) and a
    bundle's methods (``methods``: the larger of what its program plans and what its
    largest step kept)."""
    planned = model.halves.planned_method_bytes
    ledger = ledger if ledger is not None else command_ledger(model, config.budget_scope)
    if config.budget_scope == "model":
        if not ledger.has("weights"):
            ledger.add("weights", executor.weight_bytes, "computed", "the executor's weights")
            if planned:
                ledger.add("methods", planned, "computed", "the program's planned arenas")
        return ledger
    if not ledger.has("weights"):  # a model built without `slotserve.load`: not measured
        ledger.add("weights", executor.weight_bytes, "computed", "the executor's weights")
    if not ledger.has("runtime", FIRST_STEP):
        trim_heap()
        with ledger.measure("runtime", FIRST_STEP):
            first_step(model)
            trim_heap()
    if planned and not ledger.has("methods"):
        trim_heap()
        meter = ledger.meter(BUNDLE_LARGEST_STEP)
        bundle_largest_step(model)
        trim_heap()
        meter.mark("methods", at_least=planned)
    return ledger


def command_ledger(model: Model, budget_scope: str) -> MemoryLedger:
    """The ledger a command plans ``model`` in: with ``budget_scope="process"`` the one its
    load filled, else (or for a model built without `slotserve.load`) a new one, for the
    model's computed arenas and the command's own."""
    if budget_scope == "process" and model.ledger is not None:
        return model.ledger
    return MemoryLedger()


def largest_step(
    model: Model, config: EngineConfig, executor: Executor, pool: KVPool
) -> tuple[int, tuple[float, int]]:
    """Run the largest step on ``pool``, which holds no session: one prefill chunk per
    session (of ``max_seqs``, ids 0 up) ending at ``max_context``, within
    ``max_batch_tokens``; the sessions stay reserved (the caller releases them). The caller
    builds the RoPE tables first (`Model.cover_positions`: planned apart). Returns its
    tokens, and its time with the peak anonymous growth it caused (a bound: the resident
    peak less the file pages resident before it). `KVExhausted` when the pool cannot hold
    every session at ``max_context`` (a cell pool given fewer blocks)."""
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
    trim_heap()
    reset_peak()
    before = read_process()
    pool.begin_step(batch)  # inside the reading: the step's plan is the step's memory
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
    peak = read_process().peak - before.file - before.shared - before.anonymous
    return chunk * seqs, (elapsed, max(peak, 0))


def time_largest_step(
    model: Model, config: EngineConfig, executor: Executor, pool: KVPool, ledger: MemoryLedger
) -> tuple[int, float] | None:
    """Run `largest_step` on an engine's own ``pool`` (which holds no session) on a thread
    of its own, release its sessions, and return its tokens and seconds (None when the pool
    cannot hold that step's sessions at ``max_context``). It allocates nothing beyond the
    plan: the pool is the engine's and the step is the plan's largest. What the step leaves
    beyond the KV pages it wrote is one-time state: with ``budget_scope="process"`` it joins
    ``ledger``'s start arena, within the reserve a command set aside for it before sizing
    the engine (the caller checks the plan again)."""
    model.cover_positions(config.max_context)  # the plan's RoPE tables, not start state
    trim_heap()  # what earlier work freed must not offset what the step keeps
    meter = ledger.meter("the largest step")
    kv_before = pool.resident_bytes
    try:
        tokens, (seconds, _) = on_own_thread(lambda: largest_step(model, config, executor, pool))
    except KVExhausted:
        return None
    finally:
        for session in list(pool.sessions):
            pool.release(session)
        trim_heap()  # the step's freed activations leave before the server is ready
    if config.budget_scope == "process":
        # The KV pages the step wrote are the pool's arena, not start state.
        meter.mark("start", extra=-(pool.resident_bytes - kv_before))
    return tokens, seconds


def measure_cancel_bound(
    model: Model, config: EngineConfig, executor: Executor, repeats: int = 3
) -> CancelBound:
    """The cancellation bound of ``config`` on ``model`` before serving: its largest step
    (lowered to what the executor takes) run ``repeats`` times on a one-session scratch
    pool, the slowest taken."""
    tokens = largest_step_tokens(config)
    if executor.max_step_tokens is not None:
        tokens = min(tokens, executor.max_step_tokens)
    pool = KVPool(model.info, KVConfig(layout="flat", max_seqs=1, max_context=tokens))
    ids = [model.info.bos_id or 1] * tokens
    times = []
    for _ in range(max(repeats, 1)):
        pool.reserve(0, tokens)
        batch = StepBatch.single(0, tokens)
        began = time.perf_counter()  # the step's plan is made in begin_step: time it too
        pool.begin_step(batch)
        executor.step(torch.tensor(ids), batch, pool)
        times.append(time.perf_counter() - began)
        pool.release(0)
    return declare_cancel_bound(tokens, {tokens: times}, [])
