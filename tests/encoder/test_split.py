"""A forward split by layer (`EncoderPass`) on all-MiniLM-L6-v2: every split, on batches of
several shapes and on random ones (hypothesis), gives the unsplit forward's embeddings bit
for bit; the engine holds a split forward between its steps within its plan (ledger,
`check_integrity`, the /metrics gauge), releases it when its request is cancelled, and runs
an interactive request's step between its layers."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from slotserve.engine.encoder import EncoderEngine
from slotserve.engine.encoder_plan import HELD_SOURCE, EncoderConfig
from slotserve.memory import MemoryLedger
from slotserve.model.encoder import EncoderModel
from slotserve.server.ops.metrics import PrometheusMetrics

SMALL = EncoderConfig(max_texts=16, max_batch_texts=4)
WORDS = ("index", "passage", "device", "turn", "layer", "retrieval", "note", "a", "the")


def split_forward(model: EncoderModel, texts: Sequence[Sequence[int]], splits: Sequence[int]):
    """``texts`` embedded by a forward advanced ``splits[0]`` layers, then ``splits[1]``…
    (the last call runs whatever the splits leave)."""
    forward = model.start(texts)
    for layers in splits:
        if forward.layers_done == model.info.n_layers:
            break
        forward = model.advance(forward, layers)
    if forward.layers_done < model.info.n_layers:
        forward = model.advance(forward, model.info.n_layers)
    return model.finish(forward)


SPLITS = [(1,) * 6, (2, 4), (3, 3), (5, 1), (1, 2, 3), (4, 1, 1), (6,)]


@pytest.mark.parametrize("shape", ["one short", "one at the limit", "four of every length"])
def test_every_split_equals_the_unsplit_forward(minilm: EncoderModel, shape: str) -> None:
    texts = {
        "one short": ["a note"],
        "one at the limit": ["retrieval " * 400],  # truncated at max_seq_len tokens
        "four of every length": [
            "indexing on a device " * n for n in (1, 9, 30, 70)
        ],  # 64-row blocks: under one, two, several
    }[shape]
    ids = minilm.tokenize(texts)
    expected = minilm.embed(ids)
    for splits in SPLITS:
        assert torch.equal(split_forward(minilm, ids, splits), expected), splits


@settings(max_examples=25, deadline=None)
@given(
    texts=st.lists(
        st.lists(st.sampled_from(WORDS), min_size=0, max_size=120).map(" ".join),
        min_size=1,
        max_size=5,
    ),
    splits=st.lists(st.integers(1, 6), min_size=1, max_size=6),
)
def test_a_random_split_of_a_random_batch_equals_the_unsplit_forward(
    minilm: EncoderModel, texts: list[str], splits: list[int]
) -> None:
    ids = minilm.tokenize(texts)
    assert torch.equal(split_forward(minilm, ids, splits), minilm.embed(ids))


def test_a_pass_refuses_to_finish_early_or_advance_by_nothing(minilm: EncoderModel) -> None:
    forward = minilm.advance(minilm.start([[101, 2000, 102]]), 2)
    with pytest.raises(ValueError, match="has run 2 of 6 layers"):
        minilm.finish(forward)
    with pytest.raises(ValueError, match="n_layers=0 must be >= 1"):
        minilm.advance(forward, 0)


def held_gauge(engine: EncoderEngine) -> float:
    """The engine's ``slotserve_encoder_held_bytes`` as /metrics exposes it."""
    text = PrometheusMetrics(engine.stats).exposition().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "slotserve_encoder_held_bytes":
            return float(family.samples[0].value)
    raise AssertionError("no slotserve_encoder_held_bytes family")


def test_a_split_step_holds_its_forward_within_the_plan(minilm: EncoderModel) -> None:
    """The plan counts the held forward in the activations arena; between a split text's
    layers the engine holds it (stats, the gauge), within that, and `check_integrity`
    holds it there; the embeddings are the unsplit forward's."""
    texts = ["indexing on a device " * 60, "a note"]
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        held = [a.bytes for a in engine.ledger.entries if a.source == HELD_SOURCE]
        assert held == [engine.plan.held_bytes]
        assert engine.plan.held_bytes == minilm.held_bytes(4, minilm.info.max_seq_len)
        assert engine.ledger.arenas()["activations"] == engine.plan.total
        handle = engine.submit(texts, priority="background")
        seen = []
        while engine.step(budget_s=0.0):
            engine.check_integrity()
            seen.append(engine.stats().held_bytes)
            assert held_gauge(engine) == seen[-1]
        n_layers = minilm.info.n_layers
        assert len(seen) == 2 * n_layers
        assert seen[n_layers - 1] == seen[-1] == 0  # each text's last layer releases it
        assert 0 < seen[0] <= engine.plan.held_bytes
        assert seen[n_layers] < seen[0]  # the shorter text holds less
        assert torch.equal(
            handle.result(timeout=0).embeddings, minilm.embed(minilm.tokenize(texts))
        )
    finally:
        engine.close()


def test_check_integrity_finds_a_held_forward_over_the_plan(minilm: EncoderModel) -> None:
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        handle = engine.submit("retrieval " * 100, priority="background")
        engine.step(budget_s=0.0)
        engine.check_integrity()
        held = engine.stats().held_bytes
        engine.plan = dataclasses.replace(engine.plan, held_bytes=held - 1)
        with pytest.raises(AssertionError, match="exceed the plan"):
            engine.check_integrity()
        handle.cancel()
    finally:
        engine.close()


def test_cancel_mid_split_releases_the_held_forward(minilm: EncoderModel) -> None:
    """A request cancelled between its text's layers ends at the next boundary with its
    text slots free and the held forward released (its tensors collected), not run on."""
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        handle = engine.submit(["retrieval " * 100, "a note"], priority="background")
        engine.step(budget_s=0.0)
        assert engine.stats().held_bytes > 0
        assert engine._held is not None and engine._held.forward is not None
        hidden = weakref.ref(engine._held.forward.hidden)
        steps = engine.stats().steps
        handle.cancel()
        assert not engine.step(budget_s=0.0)  # nothing left to step
        stats = engine.stats()
        assert (stats.held_bytes, stats.texts_in_use, stats.running) == (0, 0, 0)
        assert stats.steps == steps
        assert held_gauge(engine) == 0
        assert hidden() is None
        assert handle.result(timeout=0).reason == "cancelled"
        engine.check_integrity()
    finally:
        engine.close()


def test_an_interactive_request_steps_between_a_held_forwards_layers(
    minilm: EncoderModel,
) -> None:
    """Interactive work keeps its priority: it runs whole in the next step while a
    background text's forward stays held, and the background text ends as it would have."""
    background = ["indexing on a device " * 60]
    engine = EncoderEngine(minilm, SMALL, ledger=MemoryLedger(), start=False)
    try:
        slow = engine.submit(background, priority="background")
        engine.step(budget_s=0.0)
        held = engine.stats().held_bytes
        assert held > 0
        fast = engine.submit(["what is the capital of France?", "a"], priority="interactive")
        assert engine.next_class() == "interactive"
        assert engine.step()
        engine.check_integrity()
        result = fast.result(timeout=0)
        assert result.reason == "stop"
        assert torch.equal(
            result.embeddings,
            minilm.embed(minilm.tokenize(["what is the capital of France?", "a"])),
        )
        assert engine.stats().held_bytes == held
        assert engine.next_class() == "background"
        while engine.step(budget_s=0.0):
            engine.check_integrity()
        assert torch.equal(
            slow.result(timeout=0).embeddings, minilm.embed(minilm.tokenize(background))
        )
    finally:
        engine.close()
