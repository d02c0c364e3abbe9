"""`EncoderEngine` on all-MiniLM-L6-v2 with its own step thread: results equal the model's,
typed errors for an empty input, an over-budget plan and a too-large batch, and a cancel
released with its measured latency, every text slot back afterwards."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from slotserve.engine.device import IDLE_AFTER_S, DeviceScheduler, DeviceSeat, TurnTaker
from slotserve.engine.encoder import EncoderEngine
from slotserve.engine.encoder_plan import EncoderConfig
from slotserve.errors import AdmissionRefused, PlanError
from slotserve.memory import MemoryLedger
from slotserve.model.encoder import EncoderModel, EncoderPass, EncoderScratch
from tests.encoder.conftest import tiny_encoder

SMALL = EncoderConfig(max_texts=16, max_batch_texts=4)


@pytest.fixture(scope="module")
def engine(minilm: EncoderModel) -> Iterator[EncoderEngine]:
    with EncoderEngine(minilm, SMALL, ledger=MemoryLedger()) as running:
        yield running


def test_embeddings_equal_the_model_across_steps(
    engine: EncoderEngine, minilm: EncoderModel
) -> None:
    texts = [f"note {i}: " + "retrieval " * (i * 7 % 40) for i in range(10)]  # 3 steps
    got = engine.embed(texts, priority="background")
    expected = torch.cat([minilm.embed([ids]) for ids in minilm.tokenize(texts)])
    assert torch.equal(got, expected)
    stats = engine.stats()
    assert stats.texts_in_use == 0 and stats.steps >= 3
    engine.check_integrity()


def test_plan_adds_activations_to_the_ledger(engine: EncoderEngine, minilm: EncoderModel) -> None:
    arenas = engine.ledger.arenas()
    assert arenas["activations"] == engine.plan.total
    assert engine.plan.step_bytes >= minilm.step_bytes(4, minilm.info.max_seq_len)


def test_empty_input_is_a_value_error(engine: EncoderEngine) -> None:
    with pytest.raises(ValueError, match="the input is empty"):
        engine.submit([])
    with pytest.raises(ValueError, match="priority='urgent'"):
        engine.submit("x", priority="urgent")


def test_batch_over_max_texts_is_refused_naming_the_limit(engine: EncoderEngine) -> None:
    with pytest.raises(AdmissionRefused, match="max_texts=16") as refused:
        engine.submit(["t"] * 17)
    assert refused.value.reason == "batch_too_large"
    assert engine.stats().refusals["batch_too_large"] >= 1


def test_over_budget_plan_refuses_to_start_naming_the_levers(minilm: EncoderModel) -> None:
    ledger = MemoryLedger()
    ledger.add("weights", minilm.weight_bytes, "computed", "test")
    budget = minilm.weight_bytes + (1 << 20)
    with pytest.raises(PlanError, match=r"max_batch_texts=4 .*lower max_batch_texts or max_texts"):
        config = EncoderConfig(max_texts=16, max_batch_texts=4, memory_budget=budget)
        EncoderEngine(minilm, config, ledger=ledger, start=False)


def test_cancel_is_acknowledged_and_releases_every_slot(engine: EncoderEngine) -> None:
    handle = engine.submit(["a long passage " * 60] * 16, priority="background")
    ack = handle.cancel(wait=True)
    assert ack is not None and ack.latency_s >= 0.0
    assert handle.result().reason in ("cancelled", "stop")  # it may have finished first
    stats = engine.stats()
    assert stats.texts_in_use == 0 and stats.running == 0
    engine.check_integrity()


def test_closed_engine_refuses(minilm: EncoderModel) -> None:
    closing = EncoderEngine(minilm, SMALL, ledger=MemoryLedger())
    closing.close()
    with pytest.raises(AdmissionRefused) as refused:
        closing.submit("late")
    assert refused.value.reason == "closed"


def test_interactive_request_passes_a_background_batch(engine: EncoderEngine) -> None:
    background = engine.submit(["a passage to index " * 40] * 12, priority="background")
    interactive = engine.submit("what did I note about the battery?", priority="interactive")
    first = interactive.result(timeout=60)
    last = background.result(timeout=60)
    assert (first.reason, last.reason) == ("stop", "stop")
    assert first.timings.released is not None and last.timings.released is not None
    assert first.timings.released < last.timings.released


def test_a_budgeted_step_cuts_a_batch_into_texts_and_layers_with_the_same_embeddings(
    minilm: EncoderModel,
) -> None:
    """A step given a time budget embeds only the whole texts its fitted cost per token and
    layer says fit, or the layers of one text that fit (at least one): a budget of nothing
    steps one layer of one text at a time, an ample one the whole batch, and the embeddings
    are the same bits either way."""
    texts = [f"passage {i}: " + "indexing on a device " * (3 + i * 5 % 30) for i in range(6)]
    expected = minilm.embed(minilm.tokenize(texts))
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        handle = engine.submit(texts, priority="background")
        while engine.step(budget_s=0.0):
            engine.check_integrity()
        assert engine.stats().steps == len(texts) * minilm.info.n_layers
        assert torch.equal(handle.result(timeout=0).embeddings, expected)
        handle = engine.submit(texts, priority="background")
        while engine.step(budget_s=3600.0):
            pass
        # max_batch_texts=4: 4 + 2 texts
        assert engine.stats().steps == len(texts) * minilm.info.n_layers + 2
        assert torch.equal(handle.result(timeout=0).embeddings, expected)
    finally:
        engine.close()


def test_a_budget_below_a_steps_fixed_cost_is_one_layer_whatever_the_slope(
    minilm: EncoderModel,
) -> None:
    """On a loaded machine the steps timed so far may take no longer for more tokens (the
    fit's slope clamps to 0): a budget below the fixed cost of a step is still one layer of
    one text a step, never the whole batch (it was: a slope of 0 read as no bound)."""
    texts = [f"passage {i}: " + "indexing on a device " * (3 + i) for i in range(4)]
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        for tokens, seconds in ((40, 0.02), (400, 0.01)):  # more tokens, less time
            engine._cost.observe(tokens, seconds)
        assert engine._cost.line()[1] == 0.0
        handle = engine.submit(texts, priority="background")
        while engine.step(budget_s=0.0):
            pass
        handle.result(timeout=0)
        assert engine.stats().steps == len(texts) * minilm.info.n_layers
    finally:
        engine.close()


def test_a_step_that_may_yield_runs_its_texts_layers_until_asked_to_stop(
    minilm: EncoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``yield_when``, a budget bounds one layer: a budget below any text's layer
    still takes one whole text a step, through every layer while nothing waits, and one
    layer a step while something always waits; the embeddings are the unsplit forward's."""
    texts = [f"note {i}: " + "retrieval " * (20 + i) for i in range(4)]
    expected = minilm.embed(minilm.tokenize(texts))
    layers = minilm.info.n_layers
    for waits, steps in ((False, len(texts)), (True, len(texts) * layers)):
        engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
        try:
            # a budget below any text's layer
            monkeypatch.setattr(engine, "_budget_units", lambda budget_s: 0)
            handle = engine.submit(texts, priority="background")
            while engine.step(
                budget_s=0.0, yield_when=(lambda: True) if waits else (lambda: False)
            ):
                engine.check_integrity()
            assert torch.equal(handle.result(timeout=0).embeddings, expected)
            assert engine.stats().steps == steps
        finally:
            engine.close()


def test_a_held_forward_outgrown_by_a_shorter_budget_gives_its_texts_back(
    minilm: EncoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of several texts composed under a long budget and stopped after a layer is
    not continued once the budget is shorter than its layer: its texts go back and are
    embedded by steps that fit (one text each here), with the same embeddings."""
    texts = [f"note {i}: " + "retrieval " * (20 + i) for i in range(3)]
    expected = minilm.embed(minilm.tokenize(texts))
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        handle = engine.submit(texts, priority="background")
        monkeypatch.setattr(engine, "_budget_units", lambda budget_s: 10**9)
        assert engine.step(budget_s=1.0, yield_when=lambda: True)
        assert engine._held is not None and len(engine._held.texts) == len(texts)
        monkeypatch.setattr(engine, "_budget_units", lambda budget_s: 0)
        held_sizes = []
        while engine.step(budget_s=0.0, yield_when=lambda: True):
            engine.check_integrity()
            held_sizes.append(0 if engine._held is None else len(engine._held.texts))
        assert torch.equal(handle.result(timeout=0).embeddings, expected)
        assert set(held_sizes) <= {0, 1}
        assert engine.stats().steps == 1 + len(texts) * minilm.info.n_layers
    finally:
        engine.close()


def test_a_turn_taker_stops_a_background_step_at_the_layer_a_user_waits_at(
    minilm: EncoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a served set's device, with no user's turn under way, an encoder's background
    turn runs its texts through every layer; once an interactive turn waits, the turn
    stops after the layer under way (the forward held) and the interactive turn goes."""
    device = DeviceScheduler(idle_turn_s=0.0)
    with device.turn("chat", "interactive"):
        pass  # an interactive step far shorter than any text's embedding
    time.sleep(IDLE_AFTER_S * 1.5)  # no user's turn under way any more
    advance = minilm._advance
    layers: list[tuple[int, int]] = []  # (the embed turn, the layer) of every layer call
    chat_after: list[int] = []  # the layer calls before the user's turn

    def chat() -> None:
        with device.turn("chat", "interactive"):
            chat_after.append(len(layers))

    def watched(forward: EncoderPass, n_layers: int, scratch: EncoderScratch | None) -> EncoderPass:
        layers.append((device.counters.turns["embed"], forward.layers_done))
        if len(layers) == 2:  # the first text's second layer: a user's turn arrives
            threading.Thread(target=chat).start()
            while ("chat", "interactive") not in device.waiting:
                time.sleep(0.001)
        return advance(forward, n_layers, scratch)

    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    monkeypatch.setattr(minilm, "_advance", watched)  # after the plan's probe steps
    turns = TurnTaker(engine, DeviceSeat(device, "embed"))
    try:
        texts = [f"note {i}: " + "retrieval " * (20 + i) for i in range(3)]
        result = engine.submit(texts, priority="background").result(timeout=120)
        monkeypatch.undo()
        assert torch.equal(result.embeddings, minilm.embed(minilm.tokenize(texts)))
        assert layers[:2] == [(1, 0), (1, 1)]  # one turn, two layers: nobody waited
        assert chat_after == [2]  # right after the layer under way when it arrived
        assert layers[2] == (2, 2)  # the text's next layer: the next embed turn
    finally:
        engine.close()
        turns.stop()
    device.check_integrity()


def test_a_step_runs_torch_on_every_core_in_a_kernel_process(
    minilm: EncoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the process's torch ops run on one thread (a GGUF chat model's load gave the
    cores to the kernels), a step's layers still run torch on every core, and the count is
    one again after it: an encoder step is torch's GEMMs."""
    seen: list[int] = []
    advance = minilm._advance

    def watched(forward: EncoderPass, n_layers: int, scratch: EncoderScratch | None) -> EncoderPass:
        seen.append(torch.get_num_threads())
        return advance(forward, n_layers, scratch)

    monkeypatch.setattr(minilm, "_advance", watched)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
        handle = engine.submit(["a note", "another note"])
        while engine.step():
            pass
        assert handle.result().reason == "stop"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    cores = len(os.sched_getaffinity(0))
    assert seen and all(count == cores for count in seen)


def test_an_embedding_is_the_same_whatever_the_callers_torch_threads() -> None:
    """The model computes on the process's cores whatever torch thread count its caller
    runs at (a GGUF chat model's load sets one), so the engine's steps, a split forward and
    `embed` agree bit for bit from any thread. On the tiny encoder (width 32) the products'
    rounding follows the thread count: most of these batches differed before."""
    model = tiny_encoder()
    batches = [
        model.tokenize([" ".join(["note", "the", "retrieval", "x"][: 1 + i % 4] * (1 + i))])
        for i in range(12)
    ]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        at_one = [model.embed(ids) for ids in batches]
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        at_all = [model.embed(ids) for ids in batches]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(at_one, at_all, strict=True))
