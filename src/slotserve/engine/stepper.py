"""`Stepper`: run one composed step: feed the chosen requests' tokens to the executor,
sample, stream.

Runs on the engine thread without the engine lock. The engine has already validated the
step and committed it in the pool (`KVPool.begin_step`, under the lock); the executor sees
the pool only through ``update_and_attend``. A request with a draft (`Speculator.draft`)
feeds its pending token and the drafted ones; the step then gives the logits of every row,
and the request's sampler verifies the draft left to right (`_verify`), delivering exactly
the tokens plain decoding would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from slotserve.engine.events import FinishReason
from slotserve.engine.request import Request
from slotserve.engine.speculate import SpeculationStats, Speculator, Work
from slotserve.executor import Executor, HiddenStates, TorchExecutor
from slotserve.kv.batch import StepBatch
from slotserve.kv.pool import KVPool
from slotserve.kv.store import KVStore
from slotserve.native.contention import Threaded, ThreadGovernor
from slotserve.native.threads import process_cores
from slotserve.sampling import sample_batch, token_logprobs
from slotserve.sampling.cpu import greedy_tokens

__all__ = ["Stepper", "Work"]


class Stepper:
    """Runs the engine's steps; ``speculator`` (None: no drafts) holds this step's drafts."""

    def __init__(
        self,
        executor: Executor,
        kv: KVStore,
        clock: Callable[[], float],
        speculator: Speculator | None = None,
    ) -> None:
        self.executor, self.kv, self.clock = executor, kv, clock
        self.speculator = speculator
        self.governor = _governor_for(executor)

    def draft(self, work: Work, pool: KVPool) -> Work:
        """Under the engine lock, before the step is committed: ``work`` with the drafts
        of the requests that speculate this step (`Speculator.draft`)."""
        if self.speculator is None:
            return work
        return self.speculator.draft(work, pool, self._threads())

    def settle(self, pool: KVPool) -> None:
        """Under the engine lock, after the step: roll rejected draft rows back."""
        if self.speculator is not None:
            self.speculator.settle(pool)

    def check_integrity(self) -> None:
        """Under the engine lock: a draft model's pool and sessions (`ModelDrafter`)."""
        if self.speculator is not None and self.speculator.drafter is not None:
            self.speculator.drafter.check_integrity()

    def speculation(self) -> SpeculationStats | None:
        """Drafted, accepted and rejected tokens so far (None: this engine never drafts)."""
        return None if self.speculator is None else self.speculator.stats()

    def run(self, work: Work, batch: StepBatch) -> list[tuple[Request, FinishReason]]:
        """Advance ``work`` by one step; ``(request, finish reason)`` for those that ended."""
        now = self.clock()
        feeds: list[int] = []
        decode_only = not any(r.in_prefill or r.pooling is not None for r, _ in work)
        for request, n in work:
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            if request.in_prefill:
                feeds.extend(request.prompt[request.prefilled : request.prefilled + n])
            else:
                assert request.pending_token is not None
                feeds.append(request.pending_token)
                if self.speculator is not None:
                    feeds.extend(self.speculator.fed(request))
        # Real time, not `clock` (tests run the engine on a synthetic one): the governor
        # weighs the cores this step really got.
        threads = self._threads()  # (the governor may change it once the step is timed)
        wall, cpu = time.perf_counter(), time.process_time()
        rows: torch.Tensor | None = None  # every row's logits (a step with drafts)
        if any(request.pooling is not None for request, _ in work):
            logits = self._step_pooling(work, torch.tensor(feeds), batch)
        elif self.speculator is not None and self.speculator.drafts:
            assert isinstance(self.executor, TorchExecutor)  # `speculator_for` checks it
            rows = self.executor.step(torch.tensor(feeds), batch, self.kv, all_logits=True)
            logits = rows[batch.last_token_rows()]
        else:
            logits = self.executor.step(torch.tensor(feeds), batch, self.kv)
        seconds = time.perf_counter() - wall
        if self.governor is not None:
            with _GOVERNOR_LOCK:
                self.governor.observe(seconds, time.process_time() - cpu)
        if self.speculator is not None and decode_only:
            self.speculator.observe_step(batch.n_tokens, seconds, threads)
        if rows is None:
            return self._sample_and_stream(work, logits)
        plain = [index for index, (r, _) in enumerate(work) if not self._drafted(r)]
        return self._verify_drafts(work, rows) + self._sample_and_stream(
            [work[index] for index in plain], logits, plain
        )

    def _threads(self) -> int:
        """The thread count the kernels run the next step on (0: no governed kernels)."""
        return 0 if self.governor is None else self.governor.threads

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

    def _drafted(self, request: Request) -> bool:
        return self.speculator is not None and request.request_id in self.speculator.drafts

    def _verify_drafts(self, work: Work, rows: torch.Tensor) -> list[tuple[Request, FinishReason]]:
        """Verify each drafting request's draft on its rows of the step's logits."""
        finished: list[tuple[Request, FinishReason]] = []
        first = 0
        for request, n in work:
            if self._drafted(request):
                reason = self._verify(request, rows[first : first + n])
                if reason is not None:
                    finished.append((request, reason))
            first += n
        return finished

    def _verify(self, request: Request, rows: torch.Tensor) -> FinishReason | None:
        """Deliver ``request``'s tokens from its ``rows`` (the pending token's, then each
        drafted token's): the sampler picks at each row in turn, as plain decoding would
        one step at a time, and the draft is accepted while it equals those picks."""
        assert self.speculator is not None
        draft = self.speculator.fed(request)
        request.pending_token = None
        sampler = request.sampler
        began = self.clock()
        # A greedy pick that nothing shapes is each row's argmax: all rows at once.
        picks = (
            greedy_tokens(rows)
            if sampler.params.greedy and not sampler.restricts and not sampler.shapes_logits
            else None
        )
        accepted, reason = 0, None
        for index in range(len(rows)):
            if picks is None:
                token = sample_batch(rows[index : index + 1], [sampler])[0]
            else:
                token = picks[index]
                sampler.accept(token)
            now = self.clock()
            reason = self._deliver(request, token, rows[index], now)
            if reason is not None or index == len(draft) or token != draft[index]:
                break
            accepted += 1
        request.timings.sampling_time += self.clock() - began
        self.speculator.verified(request, accepted)
        return reason

    def _deliver(
        self, request: Request, token: int, row: torch.Tensor, now: float
    ) -> FinishReason | None:
        """Stream ``token`` (picked from logits ``row``); why ``request`` ended with it, or
        None with the token pending (to be fed by the next step)."""
        top = request.params.logprobs
        logprob, best = token_logprobs(row, token, top) if top is not None else (None, ())
        if token in request.eos_ids:
            request.eos_token = token
            request.timings.token_times.append(now)  # it was produced, too
            return "stop"
        if request.emit_token(token, now, logprob, best):
            return "stop" if request.stops.stopped else "length"
        request.pending_token = token
        return None

    def _sample_and_stream(
        self, work: Work, logits: torch.Tensor, logit_rows: list[int] | None = None
    ) -> list[tuple[Request, FinishReason]]:
        """Sample and stream one token for each request of ``work`` whose prefill is done;
        its logits are ``logits[logit_rows[i]]`` (default: row ``i``)."""
        sampling_rows, sampling = [], []
        for index, (request, n) in enumerate(work):
            row = index if logit_rows is None else logit_rows[index]
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
        # Every row samples in a decode step: no copy (a row is a whole vocabulary of logits).
        rows = logits if len(sampling_rows) == logits.shape[0] else logits[sampling_rows]
        tokens = sample_batch(rows, [r.sampler for r in sampling])
        now = self.clock()
        share = (now - began) / len(sampling)
        for request, token, row in zip(sampling, tokens, rows, strict=True):
            request.timings.sampling_time += share
            reason = self._deliver(request, token, row, now)
            if reason is not None:
                finished.append((request, reason))
        return finished


# One governor a set of kernels: the kernels are built once a process, so every engine of
# the process (a server's models, a bench's engines with speculation on and off) sets the
# same thread counts; governors of their own would each drop or restore them on their own
# view, and one engine's steps would run on the count another's governor chose. Keyed by
# the kernels' identities (the governor holds them, so an identity is never reused).
_GOVERNORS: dict[tuple[int, ...], ThreadGovernor] = {}
# `observe` of a shared governor may come from several engine threads.
_GOVERNOR_LOCK = threading.Lock()


def _governor_for(executor: Executor) -> ThreadGovernor | None:
    """The thread governor of the model's own kernels (`slotserve.native.contention`),
    shared by every engine on them; None when the executor runs none of them (a bundle's
    program keeps its own threads)."""
    kernels = getattr(getattr(executor, "model", None), "kernels", None)
    threaded: list[Threaded] = [
        k for k in (getattr(kernels, "blocks", None), getattr(kernels, "attention", None)) if k
    ]
    if not threaded:
        return None
    key = tuple(id(kernel) for kernel in threaded)
    with _GOVERNOR_LOCK:
        governor = _GOVERNORS.get(key)
        if governor is None:  # the count the kernels were built with
            governor = _GOVERNORS[key] = ThreadGovernor(threaded, process_cores())
        return governor
