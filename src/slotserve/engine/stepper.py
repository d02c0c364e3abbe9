"""One engine step: feed the chosen requests' tokens, run the executor, sample, stream.

Runs on the engine thread without the engine lock (the pool's own mutation takes it,
through `LockedKV`). Returns the requests that finished in this step.
"""

from __future__ import annotations

import torch

from slotserve.engine.request import Request
from slotserve.executor import Executor
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.sampling import sample_batch, token_logprobs


def run_step(
    work: list[tuple[Request, int]], starts: list[int], executor: Executor, kv: KVStore
) -> list[tuple[Request, str]]:
    """Advance ``work`` by one step; ``(request, finish reason)`` for those that ended."""
    now = work[0][0].clock()
    feeds = []
    for request, n in work:
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = now
        if request.in_prefill:
            feeds.extend(request.prompt[request.prefilled : request.prefilled + n])
        else:
            assert request.pending_token is not None
            feeds.append(request.pending_token)
    batch = StepBatch([r.request_id for r, _ in work], starts, [n for _, n in work])
    logits = executor.step(torch.tensor(feeds), batch, kv)
    return _sample_and_stream(work, logits)


def _sample_and_stream(
    work: list[tuple[Request, int]], logits: torch.Tensor
) -> list[tuple[Request, str]]:
    sampling_rows, sampling = [], []
    for row, (request, n) in enumerate(work):
        if request.in_prefill:
            request.prefilled += n
            if request.in_prefill:
                continue  # more prompt chunks to come; these logits are not needed
            request.timings.prefill_done = request.clock()
            request.timings.prompt_tokens_computed = len(request.prompt)
        request.pending_token = None
        if request.max_new_tokens == 0:
            continue
        sampling_rows.append(row)
        sampling.append(request)
    finished = [(r, "length") for r, _ in work if r.max_new_tokens == 0 and not r.in_prefill]
    if not sampling:
        return finished
    rows = logits[sampling_rows]
    tokens = sample_batch(rows, [r.sampler for r in sampling])
    for request, token, row in zip(sampling, tokens, rows, strict=True):
        top = request.params.logprobs
        logprob, best = token_logprobs(row, token, top) if top is not None else (None, ())
        if token in request.eos_ids:
            request.eos_token = token
            request.timings.token_times.append(request.clock())  # it was produced, too
            finished.append((request, "stop"))
        elif request.emit_token(token, logprob, best):
            finished.append((request, "stop" if request.stops.stopped else "length"))
        else:
            request.pending_token = token
    return finished
