"""Drafts from a second model (``speculate="draft"``): a smaller model with the target's
tokenizer, or the same model in a smaller weight format, run greedily for ``k`` tokens.

Owns the draft model's KV pool (flat, one session a drafting request, sized by the engine's
``max_seqs`` and ``max_context``), which tokens each draft session holds, and the draft
steps. What a draft costs in the memory plan is `draft_arenas` (``draft_weights``,
``draft_kv``, ``draft_activations``: added to the engine's ledger before it checks its
plan, `open_draft_model`). Whether a draft is made, and how long, is the `Speculator`'s
(`slotserve.engine.speculate`); whether a drafted token is delivered is the target's own
sampler's (`slotserve.engine.stepper`), so the draft model changes how many tokens a step
delivers, never which.

A draft session holds a prefix of its request's tokens (prompt, then output). Before a
draft it is brought up to date: cut back to what it shares with the request's tokens (the
rows of rejected drafted tokens, flat: its length set back) and fed the rest, every
drafting request's rows in one step; then one step a draft position, each request that
drafts that far feeding its previous drafted token. After the target's verdict
(`roll_back`) it keeps the accepted tokens' rows, so the next draft feeds only the token
the target delivered in place of the first rejected one.

Threading: every method runs on the engine thread under the engine lock (the
`Speculator`'s `draft` and `settle`); the draft pool is this class's alone.
"""

from __future__ import annotations

import time

import torch

from slotserve.artifact import load
from slotserve.engine.config import EngineConfig
from slotserve.engine.step_cost import StepCost
from slotserve.errors import DraftModelMismatch, SessionError
from slotserve.executor import Executor, executor_for
from slotserve.kv.batch import StepBatch
from slotserve.kv.config import KVConfig
from slotserve.kv.pool import KVPool
from slotserve.memory import MemoryLedger
from slotserve.model import Model
from slotserve.plan import CapacityPlan, activation_bytes
from slotserve.sampling.cpu import greedy_tokens

DRAFT_ARENAS = ("draft_weights", "draft_kv", "draft_activations")


def draft_kv_config(config: EngineConfig) -> KVConfig:
    """The draft pool's layout: flat, a session a running request, the engine's context
    and KV dtype."""
    return KVConfig(
        layout="flat",
        max_seqs=config.max_seqs,
        max_context=config.max_context,
        dtype=config.kv_dtype,
    )


def draft_arenas(draft: Model, config: EngineConfig, executor: Executor) -> dict[str, int]:
    """The memory a draft model adds to the plan, computed: its weights (the executor's
    bytes), its KV pool and the activations of its largest step (the engine's
    ``max_batch_tokens``)."""
    kv = draft_kv_config(config)
    attention = draft.kernels.attention is not None and config.kernels == "auto"
    return {
        "draft_weights": executor.weight_bytes,
        "draft_kv": CapacityPlan(draft.info, kv).kv_bytes,
        "draft_activations": activation_bytes(draft.info, kv, config.max_batch_tokens, attention),
    }


def check_draft(draft: Model, target: Model, config: EngineConfig) -> None:
    """`DraftModelMismatch` unless ``draft`` can draft for ``target`` in an engine of
    ``config``: the same vocabulary size (a drafted id names the target's token) and a
    context of at least the engine's."""
    names = draft.source or draft.info.arch, target.source or target.info.arch
    if draft.info.vocab_size != target.info.vocab_size:
        raise DraftModelMismatch(
            *names, "a vocabulary of", draft.info.vocab_size, target.info.vocab_size
        )
    if draft.info.max_context < config.max_context:
        raise DraftModelMismatch(*names, "a context of", draft.info.max_context, config.max_context)


def open_draft_model(
    config: EngineConfig, target: Model, ledger: MemoryLedger, draft: Model | None = None
) -> Model | None:
    """The draft model of an engine that speculates with one (None otherwise): ``draft``,
    or `slotserve.load` of ``config.draft_model`` (its weights as ``draft_weights``),
    checked against ``target`` (`check_draft`), its arenas added to ``ledger`` (the engine
    checks its plan next, so a draft that does not fit is refused at start). Call it only
    where the engine will speculate (`slotserve.engine.speculate.refusal` is None)."""
    if config.speculate != "draft":
        return None
    if draft is None:
        if config.draft_model is None:
            raise ValueError(
                "speculate='draft' needs a draft model: EngineConfig.draft_model (serve and "
                "generate: --draft-model SPEC), or Engine(..., draft=model)"
            )
        draft = load(
            config.draft_model,
            progress=False,
            weights=config.draft_weights,
            kernels=config.kernels,
        )
    check_draft(draft, target, config)
    arenas = draft_arenas(draft, config, executor_for(draft))
    for name, nbytes in arenas.items():
        ledger.add(name, nbytes, "computed", f"the draft model {draft.source or draft.info.arch}")
    return draft


class ModelDrafter:
    """Greedy drafts of ``draft`` for the requests of an engine of ``config`` (module
    docstring). ``sessions`` maps a request id to the tokens its draft session holds;
    ``cost`` is fitted to the draft steps run (what a draft of ``k`` costs the step that
    verifies it, `Speculator`); until one ran, ``weight_share`` of the target's step (the
    draft's weight bytes over ``target_weight_bytes``)."""

    def __init__(self, draft: Model, config: EngineConfig, target_weight_bytes: int) -> None:
        self.model = draft
        self.executor = executor_for(draft)
        # Before a draft step was timed, one is taken to cost the target's step scaled by
        # the weights each reads (a decode step is bound by reading them).
        self.weight_share = self.executor.weight_bytes / max(target_weight_bytes, 1)
        attention = draft.kernels.attention if config.kernels == "auto" else None
        self.pool = KVPool(draft.info, draft_kv_config(config), attention)
        self.max_step_tokens = config.max_batch_tokens
        self.sessions: dict[int, list[int]] = {}
        self.cost = StepCost()

    def propose(self, wanted: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """For each request id, ``(its tokens so far, k)``: up to ``k`` tokens the draft
        model would pick greedily after them. A request whose draft session cannot catch up
        within this step's rows (a long prompt, ``max_batch_tokens``) is fed a part of what
        it lacks and drafts nothing this time."""
        feeds: dict[int, list[int]] = {}
        room = self.max_step_tokens
        for request_id, (tokens, _) in wanted.items():
            missing = self._sync(request_id, tokens)
            feeds[request_id] = missing[:room]
            room -= len(feeds[request_id])
        caught_up = {
            request_id
            for request_id, (tokens, _) in wanted.items()
            if len(self.sessions[request_id]) + len(feeds[request_id]) == len(tokens)
        }
        drafts: dict[int, list[int]] = {request_id: [] for request_id in caught_up}
        picks = self._step({r: f for r, f in feeds.items() if f})
        for request_id in caught_up:
            drafts[request_id].append(picks[request_id])
        longest = max((wanted[r][1] for r in caught_up), default=0)
        for position in range(1, longest):
            going = [r for r in caught_up if wanted[r][1] > position]
            picks = self._step({r: [drafts[r][-1]] for r in going})
            for request_id in going:
                drafts[request_id].append(picks[request_id])
        return drafts

    def roll_back(self, request_id: int, keep: int) -> None:
        """After the target's verdict: ``request_id``'s draft session keeps at most its
        first ``keep`` tokens (the request's accepted ones), the rows of the rest dropped."""
        held = self.sessions.get(request_id)
        if held is not None and len(held) > keep:
            self._cut(request_id, keep)

    def forget(self, request_id: int) -> None:
        """``request_id`` ended: its draft session is released."""
        if self.sessions.pop(request_id, None) is not None:
            self.pool.release(request_id)

    def reset(self) -> None:
        """Release every draft session (after a failed draft step: each starts again)."""
        for request_id in self.pool.session_ids():
            self.pool.release(request_id)
        self.sessions.clear()

    def check_integrity(self) -> None:
        """The draft pool's invariants, and every draft session holding as many rows as
        the tokens recorded for it."""
        self.pool.check_integrity()
        assert self.pool.session_ids() == set(self.sessions), (
            self.pool.session_ids(),
            set(self.sessions),
        )
        for request_id, held in self.sessions.items():
            assert self.pool.length(request_id) == len(held), (request_id, len(held))

    def _sync(self, request_id: int, tokens: list[int]) -> list[int]:
        """Bind or cut ``request_id``'s draft session to what it shares with ``tokens``
        (leaving at least the last token to feed, whose logits give the first draft);
        the tokens it lacks."""
        held = self.sessions.get(request_id)
        if held is None:
            self.pool.reserve(request_id, self.pool.config.max_context)
            held = self.sessions[request_id] = []
        shared = 0
        limit = min(len(held), len(tokens) - 1)
        while shared < limit and held[shared] == tokens[shared]:
            shared += 1
        if shared < len(held):
            self._cut(request_id, shared)
        return tokens[len(self.sessions[request_id]) :]

    def _cut(self, request_id: int, keep: int) -> None:
        """Keep the first ``keep`` rows of ``request_id``'s session; where the pool cannot
        (a sliding-window layer of the draft model whose ring already dropped a row it
        would need), start the session again, empty."""
        held = self.sessions[request_id]
        try:
            self.pool.rewind(request_id, len(held) - keep)
            del held[keep:]
        except SessionError:
            self.pool.release(request_id)
            self.pool.reserve(request_id, self.pool.config.max_context)
            held.clear()

    def _step(self, feeds: dict[int, list[int]]) -> dict[int, int]:
        """One draft step feeding each session its tokens; each one's greedy pick."""
        if not feeds:
            return {}
        sessions = list(feeds)
        batch = StepBatch(
            sessions, [self.pool.length(s) for s in sessions], [len(feeds[s]) for s in sessions]
        )
        self.pool.begin_step(batch)
        tokens = torch.tensor([t for s in sessions for t in feeds[s]])
        began = time.perf_counter()
        logits = self.executor.step(tokens, batch, self.pool)
        self.cost.observe(batch.n_tokens, time.perf_counter() - began)
        for session in sessions:
            self.sessions[session].extend(feeds[session])
        return dict(zip(sessions, greedy_tokens(logits), strict=True))
