"""Speculative decoding: drafts that change nothing but speed.

A request in decode feeds its pending token; with a draft it also feeds the ``k`` tokens
guessed to follow, as one chunk, and the step gives the logits of every row. The request's
own sampler then picks, left to right, the token at each position from that position's
logits, with its own random stream and history exactly as plain decoding would (it has
accepted the same tokens before it): a drafted token is accepted while it equals that pick,
and the first pick that differs is delivered in its place, the rest of the draft discarded.
A request's logits do not depend on how its tokens are chunked (the engine's exactness
rule), so every delivered token, its log-probabilities and the sampler's state are those of
plain decoding, bit for bit; only the number of steps changes.

Owns the drafts (`NgramDrafter`: prompt lookup in the request's own prompt and output; or,
with ``speculate="draft"``, a draft model's greedy tokens, `slotserve.engine.draft`), the
estimate of each request's acceptance (`Acceptance`), the cost of a step's rows
(`StepCost`), which requests draft in a step and how much (`Speculator.draft`), and the
rollback of rejected rows in the pool (`Speculator.settle`, through
`KVPool.hold_tentative` / `KVPool.roll_back`, and the draft model's own session). The
verification itself is the stepper's (`slotserve.engine.stepper`): it samples as ever.

Threading: `draft` and `settle` run on the engine thread under the engine lock (they change
the pool's lengths); `verified` runs on the engine thread without it, between them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slotserve.engine.config import SPECULATE_MODES, EngineConfig, SpeculateMode
from slotserve.engine.prefix_share import is_exact
from slotserve.engine.request import Request
from slotserve.engine.step_cost import StepCost
from slotserve.executor import Executor, TorchExecutor
from slotserve.kv.pool import KVPool, TentativeRows

if TYPE_CHECKING:  # (the engine builds it: drafting imports nothing of this module's)
    from slotserve.engine.draft import ModelDrafter

log = logging.getLogger("slotserve")

Work = list[tuple[Request, int]]  # each chosen request with the number of tokens it feeds

# The longest n-gram looked up (the longest match wins), and the shortest.
NGRAM_MAX = 3
NGRAM_MIN = 1
# A request's per-token acceptance before it has drafted, how much each draft moves the
# estimate, and how fast the estimate drifts back to the prior while it does not draft.
PRIOR_ACCEPTANCE = 0.7
ACCEPTANCE_WEIGHT = 0.3
RECOVERY_WEIGHT = 0.02
# A draft is verified only where it is expected to raise the step's delivered tokens a
# second by at least this factor: the estimates are noisy, and a step that drafts for
# nothing is slower than one that does not draft.
MIN_GAIN = 1.1


class NgramDrafter:
    """Prompt lookup over one request's tokens (prompt, then output): the tokens that
    followed the latest earlier occurrence of its last ``n`` tokens, for the longest ``n``
    from `NGRAM_MAX` down to `NGRAM_MIN` that occurred before.

    Incremental: each n-gram is indexed (by where it ends) once the token after it is
    known, so a lookup is a dictionary read per ``n`` whatever the length."""

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes n_min={n_min}, n_max={n_max}: need 1 <= n_min <= n_max")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest copy ends

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the history (the request's next prompt or output tokens)."""
        for token in tokens:
            end = len(self.tokens) - 1  # the n-grams ending here now have a follower
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                self._latest[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow the history (none: no earlier match)."""
        return self.lookup(k)[1]

    def lookup(self, k: int) -> tuple[int, list[int]]:
        """`propose`'s tokens, with the length ``n`` of the match they follow (0: none).
        A longer match is the likelier guess: its acceptance is estimated apart."""
        size = len(self.tokens)
        if k <= 0:
            return 0, []
        for n in range(min(self.n_max, size), self.n_min - 1, -1):
            end = self._latest.get(tuple(self.tokens[size - n :]))
            if end is not None:
                return n, self.tokens[end + 1 : end + 1 + k]
        return 0, []


@dataclass
class Acceptance:
    """How likely a request's next drafted token is accepted: a moving estimate of the
    per-token acceptance (a draft of ``k`` of which ``a`` were accepted counts ``a`` hits
    and, when ``a < k``, one miss), drifting back towards `PRIOR_ACCEPTANCE` while the
    request does not draft, so text that turns repetitive is tried again."""

    rate: float = 0.0

    def __post_init__(self) -> None:
        self.rate = PRIOR_ACCEPTANCE

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        misses = 1 if accepted < drafted else 0
        observed = accepted / (accepted + misses)
        self.rate += ACCEPTANCE_WEIGHT * (observed - self.rate)

    def idle(self) -> None:
        self.rate += RECOVERY_WEIGHT * (PRIOR_ACCEPTANCE - self.rate)

    def expected(self, k: int) -> float:
        """Tokens expected to be accepted of a draft of ``k``: p + p^2 + ... + p^k."""
        p = self.rate
        return sum(p**j for j in range(1, k + 1))


@dataclass
class SpeculationCounters:
    """Totals over an engine's life: drafted tokens, accepted and rejected ones, and the
    steps in which at least one request verified a draft."""

    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass(frozen=True)
class SpeculationStats:
    """An engine's speculation so far (`EngineStats.speculation`): tokens drafted, accepted
    and rejected, the steps that verified a draft, and the share of drafted tokens
    accepted."""

    drafted: int
    accepted: int
    rejected: int
    steps: int
    acceptance_rate: float


@dataclass
class _RequestState:
    request: weakref.ref[Request]
    drafter: NgramDrafter | None  # None: a draft model drafts
    # The acceptance of its drafts by how they were found: the n-gram match's length (a
    # 1-token match guesses far worse than a 3-token one), 0 for a draft model's.
    acceptances: dict[int, Acceptance] = field(default_factory=dict)

    def acceptance(self, source: int) -> Acceptance:
        return self.acceptances.setdefault(source, Acceptance())

    def idle(self) -> None:
        for acceptance in self.acceptances.values():
            acceptance.idle()


@dataclass
class Draft:
    """One request's draft in the current step: the tokens fed after its pending one, what
    the pool needs to undo rejected rows, and (once verified) how many were accepted."""

    tokens: list[int]
    held: TentativeRows
    acceptance: Acceptance  # the estimate its outcome moves
    accepted: int | None = None  # None: not verified (the step failed or it finished)


@dataclass
class Speculator:
    """Drafts for the requests of an engine's decode steps, and their rollback.

    ``max_draft`` bounds one request's draft; ``max_step_tokens`` the tokens of a step with
    drafts (the engine's ``max_batch_tokens``). A step drafts only when it is decode only
    (a prefill chunk already fills the step's rows), and only the drafts expected to raise
    the step's delivered tokens a second: each request's acceptance so far of drafts found
    the same way (`Acceptance`, one per n-gram match length) against what rows cost on this
    machine and model at the kernels' thread count (`StepCost`, fitted to the steps run and
    cautious where they cannot tell), so speculation does not slow a batch that is already
    bound by its rows. With a
    ``drafter`` (a draft model) the lengths are chosen first, as if every request had a
    proposal of its longest length, counting what the draft model's steps cost too
    (`ModelDrafter.cost`); the draft model then drafts them."""

    mode: SpeculateMode
    max_draft: int
    max_step_tokens: int
    drafter: ModelDrafter | None = None
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    cost: StepCost = field(default_factory=StepCost)
    drafts: dict[int, Draft] = field(default_factory=dict)  # request id -> this step's
    _states: dict[int, _RequestState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE_MODES:
            raise ValueError(f"speculate={self.mode!r} is not one of {SPECULATE_MODES}")
        if self.max_draft < 1:
            raise ValueError(f"speculate_max_draft={self.max_draft} must be >= 1")

    def draft(self, work: Work, pool: KVPool, threads: int = 0) -> Work:
        """Under the engine lock, before the step is committed: ``work`` with each drafting
        request's draft added to the tokens it feeds (``drafts`` holds them until
        `settle`). ``threads``: the kernels' thread count the step will run on (its rows
        are priced by the steps run on as many, `StepCost.use`)."""
        self.cost.use(threads)
        self._forget_finished()
        self.drafts.clear()  # a step that was never run (its commit refused) left them
        if self.mode == "off" or any(r.in_prefill or r.pooling is not None for r, _ in work):
            return work
        span = pool.tentative_span - 1  # a ring rolls back at most this many drafted rows
        candidates = []
        for request, _ in work:
            k = min(span, self._length_for(request))
            source, proposal = self._propose(request, k) if k > 0 else (0, [])
            if proposal:
                acceptance = self._state(request).acceptance(source)
                candidates.append((request.request_id, acceptance, proposal))
            elif request.params.speculate:
                self._state(request).idle()
        chosen = self._choose(candidates, sum(n for _, n in work), len(work))
        estimates = {request_id: acceptance for request_id, acceptance, _ in candidates}
        if self.drafter is not None and chosen:
            chosen = self._model_drafts(work, chosen)
        for request_id, tokens in chosen.items():
            if not tokens:
                continue
            start = pool.length(request_id)
            held = pool.hold_tentative(request_id, start + 1, start + 1 + len(tokens))
            self.drafts[request_id] = Draft(tokens, held, estimates[request_id])
        return [(request, n + len(chosen.get(request.request_id, ()))) for request, n in work]

    def _model_drafts(self, work: Work, chosen: dict[int, list[int]]) -> dict[int, list[int]]:
        """The draft model's tokens for the lengths ``chosen``; none where its step fails
        (logged; its sessions start again), so a draft model's fault costs drafts, never
        the requests."""
        assert self.drafter is not None
        requests = {r.request_id: r for r, _ in work}
        wanted = {
            i: ([*requests[i].prompt, *requests[i].generated], len(t)) for i, t in chosen.items()
        }
        try:
            return self.drafter.propose(wanted)
        except Exception:
            log.exception("the draft model's step failed; no drafts this step")
            self.drafter.reset()
            return {}

    def _propose(self, request: Request, k: int) -> tuple[int, list[int]]:
        """``request``'s proposal of at most ``k`` tokens, and its source (whose acceptance
        estimate it takes): the n-gram lookup's, by the match's length; with a draft model,
        ``k`` placeholders (its tokens are drafted once the lengths are chosen), source 0."""
        drafter = self._state(request).drafter
        return (0, [-1] * k) if drafter is None else drafter.lookup(k)

    def _draft_seconds(self, k: int, depth: int) -> float:
        """What a draft of ``k`` adds to the draft model's steps where the longest draft
        chosen so far is ``depth``: a row in each of its ``k`` steps, and the steps past
        ``depth`` themselves (none without a draft model)."""
        if self.drafter is None:
            return 0.0
        if self.drafter.cost.n:
            fixed, per_row = self.drafter.cost.line()
        else:  # no draft step timed yet: the target's, scaled by the weights each reads
            fixed, per_row = (self.drafter.weight_share * s for s in self.cost.line())
        return max(k - depth, 0) * fixed + k * per_row

    def _choose(
        self, candidates: list[tuple[int, Acceptance, list[int]]], rows: int, delivered: float
    ) -> dict[int, list[int]]:
        """Which proposals (by request id) to verify, and how much of each: the most likely
        first, each at the length that most raises the step's expected tokens a second (its
        rows cost what `StepCost` says; the step delivers ``delivered`` tokens without
        drafts), none where no length raises it by `MIN_GAIN`. The step stays within
        ``max_step_tokens``."""
        chosen: dict[int, list[int]] = {}  # by request id
        drafting, depth = 0.0, 0  # the draft model's seconds and steps so far
        for request_id, acceptance, proposal in sorted(candidates, key=lambda c: -c[1].rate):
            room = self.max_step_tokens - rows
            best, best_rate = 0, MIN_GAIN * delivered / (self.cost.seconds(rows) + drafting)
            for k in range(1, min(len(proposal), room) + 1):
                seconds = self.cost.seconds(rows + k) + drafting + self._draft_seconds(k, depth)
                rate = (delivered + acceptance.expected(k)) / seconds
                if rate > best_rate:
                    best, best_rate = k, rate
            if best == 0:
                acceptance.idle()
                continue
            chosen[request_id] = proposal[:best]
            rows += best
            delivered += acceptance.expected(best)
            drafting += self._draft_seconds(best, depth)
            depth = max(depth, best)
        return chosen

    def observe_step(self, rows: int, seconds: float, threads: int = 0) -> None:
        """A decode-only step of ``rows`` rows took ``seconds`` on ``threads`` threads (the
        cost model of that thread count learns)."""
        self.cost.use(threads)
        self.cost.observe(rows, seconds)

    def fed(self, request: Request) -> list[int]:
        """The tokens ``request`` feeds after its pending one in this step."""
        draft = self.drafts.get(request.request_id)
        return [] if draft is None else draft.tokens

    def verified(self, request: Request, accepted: int) -> None:
        """The stepper's verdict: the first ``accepted`` drafted tokens of ``request`` were
        delivered (and fed: its KV keeps them). Counted in the request's timings too."""
        draft = self.drafts[request.request_id]
        draft.accepted = accepted
        request.timings.drafted_tokens += len(draft.tokens)
        request.timings.accepted_tokens += accepted

    def settle(self, pool: KVPool) -> None:
        """Under the engine lock, after the step and before anything is released: roll
        every verified draft's rejected rows back in the pool and count the step. A draft
        never verified (the step failed) is left alone: its request ends with an error."""
        if not self.drafts:
            return
        counters = self.counters
        counters.steps += 1
        for request_id, draft in self.drafts.items():
            if draft.accepted is None:
                continue
            held, drafted = draft.held, len(draft.tokens)
            pool.roll_back(held, held.from_position + draft.accepted)
            if self.drafter is not None:
                self.drafter.roll_back(request_id, held.from_position + draft.accepted)
            counters.drafted += drafted
            counters.accepted += draft.accepted
            counters.rejected += drafted - draft.accepted
            draft.acceptance.observe(drafted, draft.accepted)
        self.drafts.clear()

    def stats(self) -> SpeculationStats:
        counters = self.counters
        return SpeculationStats(
            counters.drafted,
            counters.accepted,
            counters.rejected,
            counters.steps,
            counters.acceptance_rate,
        )

    def _length_for(self, request: Request) -> int:
        """This step's draft length for ``request`` (0: it does not draft)."""
        if not request.params.speculate or request.pending_token is None:
            return 0
        # Every position drafted past the request's last one would be discarded.
        remaining = request.max_new_tokens - len(request.generated) - 1
        if remaining <= 0:
            return 0
        return min(self.max_draft, remaining)

    def _state(self, request: Request) -> _RequestState:
        """``request``'s drafter and draft length, its history brought up to date."""
        state = self._states.get(request.request_id)
        if state is None:
            ngram = NgramDrafter() if self.drafter is None else None
            state = _RequestState(weakref.ref(request), ngram)
            if ngram is not None:
                ngram.extend(request.prompt)
            self._states[request.request_id] = state
        if state.drafter is not None:
            known = len(state.drafter.tokens) - len(request.prompt)
            state.drafter.extend(request.generated[known:])
        return state

    def _forget_finished(self) -> None:
        for request_id, state in list(self._states.items()):
            request = state.request()
            if request is None or request.state == "done":
                del self._states[request_id]
                if self.drafter is not None:
                    self.drafter.forget(request_id)


def refusal(config: EngineConfig, executor: Executor) -> str | None:
    """Why an engine of ``config`` on ``executor`` may not speculate (None: it may): an
    executor that gives only each sequence's last logits, or a model whose logits may
    depend on the chunking (`is_exact`)."""
    if not isinstance(executor, TorchExecutor):
        return (
            f"the executor {type(executor).__name__} gives only each sequence's last logits, "
            "and a draft is verified on every row's"
        )
    model = executor.model
    if not is_exact(model, config):
        attention = model.kernels.attention is not None and config.kernels == "auto"
        return (
            f"{model.source or model.info.arch} runs {model.halves.kind} halves (attention "
            f"kernel {'on' if attention else 'off'}), where a chunk's logits may differ from "
            "one token's in the last bits, so a draft could change the output; GGUF block "
            "weights on the compiled kernels keep it exact"
        )
    return None


def speculator_for(
    config: EngineConfig, executor: Executor, drafter: ModelDrafter | None = None
) -> Speculator | None:
    """The engine's `Speculator` (None with ``speculate="off"``, or where drafts cannot be
    verified exactly, `refusal`, the reason logged); ``drafter``: the draft model's, with
    ``speculate="draft"``."""
    if config.speculate == "off":
        return None
    reason = refusal(config, executor)
    if reason is not None:
        log.info("speculate=%s refused: %s", config.speculate, reason)
        return None
    if (config.speculate == "draft") != (drafter is not None):
        raise ValueError(f"speculate={config.speculate!r} with drafter={drafter!r}")
    return Speculator(
        config.speculate, config.speculate_max_draft, config.max_batch_tokens, drafter
    )
