"""`Stepper`: run one composed step: feed the chosen requests' tokens to the executor,
sample, stream.

Runs on the engine thread without the engine lock. The engine has already validated the
step and committed it in the pool (`KVPool.begin_step`, under the lock); the executor sees
the pool only through ``update_and_attend``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from slotserve.engine.events import FinishReason
from slotserve.engine.request import Request
from slotserve.executor import Executor, HiddenStates
from slotserve.kv.batch import StepBatch
from slotserve.kv.store import KVStore
from slotserve.native.contention import Threaded, ThreadGovernor
from slotserve.native.threads import process_cores
from slotserve.sampling import sample_batch, token_logprobs

Work = list[tuple[Request, int]]  # each chosen request with the number of tokens it feeds


class Stepper:
    def __init__(self, executor: Executor, kv: KVStore, clock: Callable[[], float]) -> None:
        self.executor, self.kv, self.clock = executor, kv, clock
        self.governor = _governor_for(executor)

    def run(self, work: Work, batch: StepBatch) -> list[tuple[Request, FinishReason]]:
        """Advance ``work`` by one step; ``(request, finish reason)`` for those that ended."""
        now = self.clock()
        feeds: list[int] = []
        for request, n in work:
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            if request.in_prefill:
                feeds.extend(request.prompt[request.prefilled : request.prefilled + n])
            else:
                assert request.pending_token is not None
                feeds.append(request.pending_token)
        # Real time, not `clock` (tests run the engine on a synthetic one): the governor
        # weighs the cores this step really got.
        wall, cpu = time.perf_counter(), time.process_time()
        if any(request.pooling is not None for request, _ in work):
            logits = self._step_pooling(work, torch.tensor(feeds), batch)
        else:
            logits = self.executor.step(torch.tensor(feeds), batch, self.kv)
        if self.governor is not None:
            self.governor.observe(time.perf_counter() - wall, time.process_time() - cpu)
        return self._sample_and_stream(work, logits)

    def _step_pooling(self, work: Work, feeds: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The step, with the final hidden states of each embedding request's rows pooled
        into it (its rows on the step's axis follow the work's order)."""
        assert isinstance(self.executor, HiddenStates)  # Engine.submit checks it
        logits, hidden = self.executor.hidden_step(feeds, batch, self.kv)
        row = 0
        for request, n in work:
            if request.pooling is not None:
                request.pool_rows(hidden[row : row + n])
            row += n
        return logits

    def _sample_and_stream(
        self, work: Work, logits: torch.Tensor
    ) -> list[tuple[Request, FinishReason]]:
        sampling_rows, sampling = [], []
        for row, (request, n) in enumerate(work):
            if request.in_prefill:
                request.prefilled += n
                if request.in_prefill:
                    continue  # more prompt chunks to come; these logits are not needed
                request.timings.prefill_done = self.clock()
                timings = request.timings
                timings.prompt_tokens_computed = (
                    len(request.prompt) - timings.prompt_tokens_restored
                )
            request.pending_token = None
            if request.max_new_tokens == 0:
                continue
            sampling_rows.append(row)
            sampling.append(request)
        finished: list[tuple[Request, FinishReason]] = [
            (r, "length") for r, _ in work if r.max_new_tokens == 0 and not r.in_prefill
        ]
        if not sampling:
            return finished
        began = self.clock()
        # Every row samples in a decode step: no copy (8 MB of Gemma 3 logits at 8 rows).
        rows = logits if len(sampling_rows) == logits.shape[0] else logits[sampling_rows]
        tokens = sample_batch(rows, [r.sampler for r in sampling])
        now = self.clock()
        share = (now - began) / len(sampling)
        for request, token, row in zip(sampling, tokens, rows, strict=True):
            request.timings.sampling_time += share
            top = request.params.logprobs
            logprob, best = token_logprobs(row, token, top) if top is not None else (None, ())
            if token in request.eos_ids:
                request.eos_token = token
                request.timings.token_times.append(now)  # it was produced, too
                finished.append((request, "stop"))
            elif request.emit_token(token, now, logprob, best):
                finished.append((request, "stop" if request.stops.stopped else "length"))
            else:
                request.pending_token = token
        return finished


def _governor_for(executor: Executor) -> ThreadGovernor | None:
    """The thread governor of the model's own kernels (`slotserve.native.contention`);
    None when the executor runs none of them (a bundle's program keeps its own threads)."""
    kernels = getattr(getattr(executor, "model", None), "kernels", None)
    threaded: list[Threaded] = [
        k for k in (getattr(kernels, "blocks", None), getattr(kernels, "attention", None)) if k
    ]
    if not threaded:
        return None
    return ThreadGovernor(threaded, process_cores())  # the count the kernels were built with
