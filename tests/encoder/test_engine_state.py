"""`EncoderEngine` under random operation sequences (hypothesis state machine): submit,
cancel, drop a handle, step (whole, or with a budget of nothing: one layer of one text, the
forward held between steps; or told to stop between layers, as a device's turn-taker does),
let time pass, close; the engine is stepped by the test
(``start=False``) on a synthetic clock, so every check is exact.

The machine keeps its own model of admission (which requests run, which wait, which are
refused and why) and checks the engine against it and against its own invariants after
every step: text slots equal the running requests' texts and stay within ``max_texts``,
the ledger holds, a step serves one class (interactive first, background only its share and
never two steps running while interactive work waits), and every finished request's
embeddings equal, bit for bit, the model's on its texts alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slotserve.engine.encoder import EncoderEngine
from slotserve.engine.encoder_plan import EncoderConfig
from slotserve.engine.encoder_request import EmbeddingHandle, EmbeddingResult
from slotserve.engine.events import PRIORITIES, Priority
from slotserve.errors import AdmissionRefused
from tests.encoder.conftest import tiny_encoder

CONFIG = EncoderConfig(max_texts=6, max_batch_texts=3, queue_depth=2, queue_timeout_s=5.0)
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
texts_strategy = st.lists(
    st.lists(st.sampled_from(WORDS), min_size=0, max_size=30).map(" ".join),
    min_size=1,
    max_size=8,
)


@dataclass
class Tracked:
    """The machine's model of one submitted request."""

    request_id: int
    texts: list[str]
    priority: Priority
    state: str  # "running" | "queued" | "done"
    deadline: float | None
    handle: EmbeddingHandle | None
    cancelled: bool = False


class EncoderEngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.model = tiny_encoder()
        self.engine = EncoderEngine(self.model, CONFIG, clock=lambda: self.now, start=False)
        # What a budget buys, fixed rather than fitted to this machine's step times: 0 s one
        # layer of one text, 60 s every text of a batch.
        self.engine._budget_units = lambda s: None if s is None else int(s * 10**6)  # type: ignore[method-assign]
        self.tracked: list[Tracked] = []
        self.background_while_interactive = False  # the last step did that

    # -- the model of admission ------------------------------------------------------

    def _in_use(self) -> int:
        return sum(len(t.texts) for t in self.tracked if t.state == "running")

    def _queued(self) -> list[Tracked]:
        return [t for t in self.tracked if t.state == "queued"]

    def _readmit(self) -> None:
        for t in sorted(self._queued(), key=lambda t: PRIORITIES.index(t.priority)):
            if self._in_use() + len(t.texts) > CONFIG.max_texts:
                break
            t.state = "running"

    def _reap(self) -> list[tuple[Tracked, str]]:
        """What the engine's batch boundary does: cancels end (queued or running),
        expired waits are refused, then the queue is re-admitted. The ends to read once the
        engine has stepped."""
        ends = []
        for t in self.tracked:
            if t.cancelled and t.state in ("queued", "running"):
                ends.append((t, "cancelled"))
            elif t.state == "queued" and t.deadline is not None and self.now >= t.deadline:
                ends.append((t, "queue_timeout"))
            else:
                continue
            t.state = "done"
        self._readmit()
        return ends

    @staticmethod
    def _read_end(t: Tracked, reason: str) -> None:
        if t.handle is None:  # a dropped handle's result has no reader
            return
        if reason == "queue_timeout":
            with pytest.raises(AdmissionRefused) as refused:
                t.handle.result(timeout=0)
            assert refused.value.reason == "queue_timeout"
        else:
            assert t.handle.result(timeout=0).reason == reason

    def _check_result(self, t: Tracked, result: EmbeddingResult) -> None:
        ids = self.model.tokenize(t.texts)
        assert result.prompt_tokens == sum(len(i) for i in ids)
        assert result.priority == t.priority
        expected = torch.cat([self.model.embed([one]) for one in ids])
        assert torch.equal(result.embeddings, expected)

    # -- operations ------------------------------------------------------------------

    @rule(texts=texts_strategy, priority=st.sampled_from(PRIORITIES), may_queue=st.booleans())
    def submit(self, texts: list[str], priority: Priority, may_queue: bool) -> None:
        n, queued = len(texts), self._queued()
        ahead = any(PRIORITIES.index(t.priority) <= PRIORITIES.index(priority) for t in queued)
        if n > CONFIG.max_texts:
            expected = "batch_too_large"
        elif self._in_use() + n <= CONFIG.max_texts and not ahead:
            expected = "running"
        elif not may_queue:
            expected = "slots_full"
        elif len(queued) >= CONFIG.queue_depth:
            expected = "queue_full"
        else:
            expected = "queued"
        try:
            handle = self.engine.submit(texts, priority, may_queue=may_queue)
        except AdmissionRefused as refused:
            assert refused.reason == expected
            return
        assert expected in ("running", "queued"), expected
        deadline = self.now + CONFIG.queue_timeout_s if expected == "queued" else None
        self.tracked.append(Tracked(handle.request_id, texts, priority, expected, deadline, handle))

    @precondition(lambda self: any(t.state != "done" for t in self.tracked))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = [t for t in self.tracked if t.state != "done" and t.handle is not None]
        if not live:
            return
        t = data.draw(st.sampled_from(live))
        assert t.handle is not None
        assert t.handle.cancel() is None
        t.cancelled = True

    @precondition(lambda self: any(t.handle is not None for t in self.tracked))
    @rule(data=st.data())
    def drop_handle(self, data: st.DataObject) -> None:
        """A caller that lets go of its handle without cancel: reclaimed as a cancel."""
        held = [t for t in self.tracked if t.handle is not None]
        t = data.draw(st.sampled_from(held))
        t.handle = None  # the last reference: its finalizer runs now
        if t.state != "done":
            t.cancelled = True

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def pass_time(self, seconds: float) -> None:
        self.now += seconds

    @rule(budget=st.sampled_from([None, 0.0, 60.0]), yield_after=st.sampled_from([None, 1, 2]))
    def step(self, budget: float | None, yield_after: int | None) -> None:
        """A step (``budget`` 0: one layer of one text, the forward held between steps;
        60 s: every ready text, up to a batch). With ``yield_after`` the step is told to
        stop once it has asked that many times (between layers, as a device's turn-taker
        asks whether a turn above waits), and a budget then bounds one layer: a large step
        stopped after a layer and then outgrown by a budget of nothing gives its texts
        back."""
        ends = self._reap()
        ready = {t.priority for t in self.tracked if t.state == "running" and not t.cancelled}
        before = self.engine.stats().steps_by_class
        asked = itertools.count(1)
        yield_when = None if yield_after is None else (lambda: next(asked) >= yield_after)
        stepped = self.engine.step(budget, yield_when)
        assert stepped == bool(ready)
        for t, reason in ends:
            self._read_end(t, reason)
        after = self.engine.stats().steps_by_class
        served = [c for c in PRIORITIES if after.get(c, 0) != before.get(c, 0)]
        if not ready:
            assert served == []
            return
        highest = next(c for c in PRIORITIES if c in ready)
        assert len(served) == 1 and served[0] in ready
        assert served[0] in (highest, "background")
        share_step = served[0] == "background" != highest
        if share_step and "interactive" in ready:
            assert not self.background_while_interactive, "interactive waited two steps"
        self.background_while_interactive = share_step and "interactive" in ready
        for t in self.tracked:
            if t.state == "running" and t.handle is not None:
                try:
                    result = t.handle.result(timeout=0)
                except TimeoutError:
                    continue
                assert result.reason == "stop"
                self._check_result(t, result)
                t.state = "done"
        self._readmit()

    @rule()
    def a_user_turn_arrives_mid_step(self) -> None:
        """A step with time to spare (nobody else on the device) stopped after its first
        layer because a user's turn arrived, then the next step under a budget of nothing
        (the turns are short now): a held forward of several texts gives them back."""
        self.step(60.0, 1)
        self.step(0.0, 1)

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.engine.check_integrity()
        stats = self.engine.stats()
        assert stats.texts_in_use <= CONFIG.max_texts
        if all(t.handle is not None for t in self.tracked if t.state == "running"):
            assert stats.texts_in_use == self._in_use()
            assert stats.queue_len == len(self._queued())

    def teardown(self) -> None:
        self.engine.close()
        stats = self.engine.stats()
        assert (stats.texts_in_use, stats.running, stats.queue_len) == (0, 0, 0)
        for t in self.tracked:
            if t.handle is not None and t.state != "done":
                try:
                    result = t.handle.result(timeout=0)
                except AdmissionRefused as refused:
                    assert refused.reason == "closed"
                else:
                    assert result.reason == "cancelled"
        self.engine.check_integrity()


EncoderEngineMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None
)
TestEncoderEngine = EncoderEngineMachine.TestCase
