"""Speculation with a draft model (``speculate="draft"``) changes nothing but the number of
steps: a request's tokens and their log-probabilities are equal, bit for bit, to plain
decoding's, on the bundled model's Q4_1 blocks drafted for by the same file's fp32 weights
(a real pair that needs nothing beyond the bundled file) and on tiny GGUF models drafted
for by the same weights in another block type and by an unrelated model (drafts mostly
rejected), on flat, cell and ring, alone or beside another request. The draft model's own
sessions are checked against greedy decoding from scratch after every draft and rollback;
a draft model of another vocabulary is refused; its memory is in the plan."""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.draft import DRAFT_ARENAS, ModelDrafter
from slotserve.engine.speculate import Acceptance, Speculator, StepCost
from slotserve.errors import DraftModelMismatch
from slotserve.testing import write_tiny_gguf
from tests.speculative.test_exactness import (
    COPYING,
    LAYOUTS,
    Case,
    CheapRows,
    cases,
    run,
)


class FreeDrafts(StepCost):
    """A draft-step cost of nothing, whatever this machine's load: with `CheapRows` the
    engine drafts wherever it may, so the property is tested on many drafts."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def line(self) -> tuple[float, float]:
        return 0.0, 0.0


def drafting(model: ss.Model, draft: ss.Model, config: ss.EngineConfig) -> ss.Engine:
    """An engine drafting with ``draft`` wherever it can (the test fixes the cost models)."""
    engine = ss.Engine(model, replace(config, speculate="draft"), draft=draft)
    speculator = engine._stepper.speculator
    assert speculator is not None and speculator.drafter is not None
    speculator.cost = CheapRows()
    speculator.drafter.cost = FreeDrafts(n=1.0)  # fitted: the weights' prior is not used
    return engine


def short(case: Case) -> Case:
    """``case`` with prompts a byte-level tokenizer keeps within a tiny model's context."""
    beside = None if case.beside is None else case.beside[:60]
    return replace(case, prompt=case.prompt[:100], beside=beside)


def check_equal_output(
    model: ss.Model, draft: ss.Model, config: dict[str, Any], examples: int, accepted: bool
) -> None:
    on = drafting(model, draft, ss.EngineConfig(**config))
    off = ss.Engine(model, ss.EngineConfig(speculate="off", **config))

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases().map(short))
    @example(case=COPYING)
    def equal(case: Case) -> None:
        assert run(on, case) == run(off, case)  # each run checks the draft pool too

    try:
        equal()
        stats = on.stats().speculation
        assert stats is not None and stats.drafted > 0
        assert stats.drafted == stats.accepted + stats.rejected
        if accepted:
            assert stats.accepted > 0
    finally:
        for engine in (on, off):
            engine.close()
            engine.check_integrity()
            assert engine.stats().slots_in_use == 0


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ss.Model]:
    """A tiny target on Q4_0 blocks; the same weights on Q8_0 blocks (a close draft); an
    unrelated one-layer model of the same vocabulary (a poor draft)."""
    root = tmp_path_factory.mktemp("drafts")
    paths = {
        "target": write_tiny_gguf(root / "target.gguf", qtype="Q4_0", seed=3),
        "close": write_tiny_gguf(root / "close.gguf", qtype="Q8_0", seed=3),
        "other": write_tiny_gguf(root / "other.gguf", qtype="Q8_0", seed=9, layers=1),
    }
    models = {name: ss.load(path, progress=False) for name, path in paths.items()}
    assert models["target"].halves.kind == "block"
    return models


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_bundled_blocks_drafted_for_by_their_fp32_weights_give_the_same_output(
    bundled_blocks: ss.Model, bundled: ss.Model, layout: str
) -> None:
    config = {**LAYOUTS[layout], "max_seqs": 2, "max_context": 160, "policy": "fifo"}
    check_equal_output(bundled_blocks, bundled, config, examples=4, accepted=True)


@pytest.mark.parametrize("draft", ["close", "other"])
@pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiny_models_give_the_same_output_with_a_draft_model(
    tiny_pair: dict[str, ss.Model], layout: str, prefix: bool, draft: str
) -> None:
    config = {
        **LAYOUTS[layout],
        "max_seqs": 2,
        "max_context": 160,
        "policy": "fifo",
        "prefix_cache_bytes": "1MiB" if prefix else 0,
    }
    check_equal_output(
        tiny_pair["target"], tiny_pair[draft], config, examples=6, accepted=draft == "close"
    )


def greedy(model: ss.Model, tokens: list[int], k: int) -> list[int]:
    """``k`` greedy tokens after ``tokens``, each from teacher-forced logits from scratch."""
    out: list[int] = []
    for _ in range(k):
        out.append(int(ss.teacher_forced_logits(model, [*tokens, *out])[-1].argmax()))
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), rounds=st.integers(2, 8))
def test_draft_sessions_follow_their_requests_through_rollbacks(
    tiny_pair: dict[str, ss.Model], seed: int, rounds: int
) -> None:
    """Requests whose tokens grow by random accepted drafts and a token of their own, some
    drafting, some ending: every draft equals greedy decoding of the draft model from
    scratch over the request's tokens (its session kept exactly in step), and the draft
    pool's invariants hold after every draft and rollback."""
    draft = tiny_pair["close"]
    rng = random.Random(seed)
    drafter = ModelDrafter(draft, ss.EngineConfig(max_seqs=3, max_context=96), draft.weight_bytes)
    histories = {i: [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))] for i in range(3)}
    for _ in range(rounds):
        wanted = {
            i: (tokens, rng.randint(1, 4))
            for i, tokens in histories.items()
            if rng.random() < 0.8 and len(tokens) + 10 < 96
        }
        drafts = drafter.propose(wanted)
        drafter.check_integrity()
        assert set(drafts) == set(wanted)
        for i, proposed in drafts.items():
            assert proposed == greedy(draft, histories[i], wanted[i][1])
            accepted = rng.randint(0, len(proposed))
            histories[i] += [*proposed[:accepted], rng.randrange(3, 200)]
            drafter.roll_back(i, len(histories[i]) - 1)
            drafter.check_integrity()
        if rng.random() < 0.2:
            ended = rng.choice(list(histories))
            drafter.forget(ended)
            histories[ended] = [rng.randrange(3, 200)]
            drafter.check_integrity()


def test_a_long_history_catches_up_over_several_drafts(tiny_pair: dict[str, ss.Model]) -> None:
    """A draft session that lacks more tokens than a step holds is fed a step's worth and
    drafts nothing that time; it drafts once it caught up."""
    draft = tiny_pair["close"]
    drafter = ModelDrafter(
        draft, ss.EngineConfig(max_seqs=1, max_context=96, max_batch_tokens=16), draft.weight_bytes
    )
    tokens = list(range(3, 43))
    assert drafter.propose({0: (tokens, 2)}) == {}
    assert drafter.propose({0: (tokens, 2)}) == {}
    assert drafter.propose({0: (tokens, 2)}) == {0: greedy(draft, tokens, 2)}
    drafter.check_integrity()


def test_a_draft_model_of_another_vocabulary_is_refused(
    tiny_pair: dict[str, ss.Model], bundled: ss.Model
) -> None:
    config = ss.EngineConfig(max_seqs=1, max_context=64, speculate="draft")
    with pytest.raises(DraftModelMismatch) as refused:
        ss.Engine(tiny_pair["target"], config, draft=bundled)
    message = str(refused.value)
    assert str(bundled.info.vocab_size) in message
    assert str(tiny_pair["target"].info.vocab_size) in message
    with pytest.raises(ValueError, match="needs a draft model"):
        ss.Engine(tiny_pair["target"], config)


def test_the_draft_model_is_in_the_memory_plan(tiny_pair: dict[str, ss.Model]) -> None:
    """Its weights, KV pool and activations are arenas of the plan, computed; a budget that
    holds the engine without them refuses the engine with them."""
    target, draft = tiny_pair["target"], tiny_pair["close"]
    config = ss.EngineConfig(max_seqs=2, max_context=64, speculate="draft")
    with ss.Engine(target, config, draft=draft) as engine:
        arenas = engine.plan.arenas
        speculator = engine._stepper.speculator
        assert speculator is not None and speculator.drafter is not None
        assert arenas["draft_kv"] == speculator.drafter.pool.nbytes
        assert arenas["draft_weights"] == draft.weight_bytes
        assert arenas["draft_activations"] > 0
        assert {e.how for e in engine.ledger.entries if e.name in DRAFT_ARENAS} == {"computed"}
        without = sum(b for name, b in arenas.items() if name not in DRAFT_ARENAS)
    with ss.Engine(target, replace(config, speculate="off")) as plain:
        assert not set(DRAFT_ARENAS) & set(plain.plan.arenas)
    with pytest.raises(ss.PlanError):
        ss.Engine(target, replace(config, memory_budget=without), draft=draft)


def test_a_draft_model_is_loaded_from_its_spec(tiny_pair: dict[str, ss.Model]) -> None:
    """``draft_model`` names a file the engine loads (``draft_weights`` its format)."""
    source = tiny_pair["close"].source
    assert source is not None
    config = ss.EngineConfig(
        max_seqs=1, max_context=64, speculate="draft", draft_model=source, draft_weights="fp32"
    )
    with ss.Engine(tiny_pair["target"], config) as engine:
        speculator = engine._stepper.speculator
        assert speculator is not None and speculator.drafter is not None
        assert speculator.drafter.model.halves.kind == "eager"
        assert Path(speculator.drafter.model.source or "") == Path(source)
        # A random model may pick its end-of-sequence token first: the test is the load.
        params = ss.SamplingParams(max_new_tokens=8, ignore_eos=True)
        handle = engine.submit("hello hello hello", params)
        assert handle.result().usage.completion_tokens > 0
        engine.check_integrity()


def test_draft_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="speculate='draft'"):
        ss.EngineConfig(draft_model="bundled", speculate="ngram")
    with pytest.raises(ValueError, match="draft_weights='q2'"):
        ss.EngineConfig(speculate="draft", draft_model="bundled", draft_weights="q2")


def test_logits_of_the_draft_are_never_used_for_output(tiny_pair: dict[str, ss.Model]) -> None:
    """A greedy request's tokens with a poor draft model (mostly rejected) are the plain
    engine's, and some drafts were rejected: what the target delivers is its own pick."""
    target, other = tiny_pair["target"], tiny_pair["other"]
    config = ss.EngineConfig(max_seqs=1, max_context=96)
    params = ss.SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    prompt = "the red fox jumps over the lazy dog"
    with drafting(target, other, config) as engine:
        tokens = engine.submit(prompt, params).result().tokens
        stats = engine.stats().speculation
        engine.check_integrity()
    with ss.Engine(target, config) as plain:
        assert plain.submit(prompt, params).result().tokens == tokens
    assert stats is not None and stats.rejected > 0
    assert torch.tensor(tokens).max() < target.info.vocab_size


def test_a_draft_is_made_only_where_its_steps_leave_a_gain(tiny_pair: dict[str, ss.Model]) -> None:
    """The draft model's steps count against a draft: on a weight-bound target (rows nearly
    free) a draft model a hundredth of its weights drafts at length, one as large as the
    target does not; once draft steps were timed their fit replaces the weights' prior."""
    config = ss.EngineConfig(max_seqs=1, max_context=96)
    draft = tiny_pair["close"]
    likely = Acceptance()
    likely.rate = 0.9
    chosen = {}
    for share in (0.01, 1.0):
        drafter = ModelDrafter(draft, config, int(draft.weight_bytes / share))
        speculator = Speculator("draft", 8, 64, drafter)
        for rows in (1, 2, 4, 8) * 5:
            speculator.observe_step(rows, 0.020 + 0.0005 * rows)
        chosen[share] = speculator._choose([(0, likely, [-1] * 8)], rows=1, delivered=1.0)
    assert len(chosen[0.01][0]) >= 6 and chosen[1.0] == {}
    drafter = ModelDrafter(draft, config, draft.weight_bytes)  # as large as the target
    speculator = Speculator("draft", 8, 64, drafter)
    for rows in (1, 2, 4, 8) * 5:
        speculator.observe_step(rows, 0.020 + 0.0005 * rows)
        drafter.cost.observe(rows, 0.0001 + 0.00001 * rows)  # but its steps timed cheap
    assert len(speculator._choose([(0, likely, [-1] * 8)], rows=1, delivered=1.0)[0]) >= 6


def test_the_flags_choose_a_draft_model() -> None:
    """``--draft-model`` drafts with that model (serve's n-gram default gives way to it);
    ``--speculate off`` with a draft model is refused, naming both."""
    from slotserve.cli import build_parser
    from slotserve.cli.flags import engine_config
    from slotserve.cli.serve import with_server_speculation

    parse = build_parser().parse_args
    args = parse(["serve", "--draft-model", "draft.gguf", "--draft-weights", "int8"])
    config = with_server_speculation(engine_config(args), args)
    assert (config.speculate, config.draft_model, config.draft_weights) == (
        "draft",
        "draft.gguf",
        "int8",
    )
    plain = parse(["serve"])
    assert with_server_speculation(engine_config(plain), plain).speculate == "ngram"
    with pytest.raises(ValueError, match=r"draft_model='draft\.gguf'.*'off'"):
        engine_config(parse(["serve", "--draft-model", "draft.gguf", "--speculate", "off"]))


def test_the_runner_drafts_with_a_draft_model(tiny_pair: dict[str, ss.Model]) -> None:
    """`TextLLMRunner(speculate="draft", draft_model=...)` gives the plain runner's tokens."""
    target, draft = tiny_pair["target"], tiny_pair["close"]
    config = ss.GenerationConfig(max_new_tokens=24, temperature=0.0, echo=False)
    results = []
    for kwargs in ({"speculate": "draft", "draft_model": draft}, {"speculate": "off"}):
        runner = ss.TextLLMRunner(target, max_context=96, **kwargs)  # type: ignore[arg-type]
        try:
            results.append(runner.generate("the red fox, the red fox, the red", config).tokens)
        finally:
            runner.close()
    assert results[0] == results[1] and results[0]


def test_a_failing_draft_costs_drafts_never_the_request(
    tiny_pair: dict[str, ss.Model], caplog: pytest.LogCaptureFixture
) -> None:
    """A draft step that fails (here: the draft pool's every slot taken by sessions of no
    request, so a drafting request cannot bind one) is logged and drafts nothing; the draft
    sessions start again, and the request's output is plain decoding's."""
    target, draft = tiny_pair["target"], tiny_pair["close"]
    config = ss.EngineConfig(max_seqs=1, max_context=96)
    params = ss.SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompt = "the red fox, the red fox, the red"
    with drafting(target, draft, config) as engine:
        speculator = engine._stepper.speculator
        assert speculator is not None and speculator.drafter is not None
        speculator.drafter.pool.reserve(999, 8)  # the draft pool's one slot, held
        with caplog.at_level(logging.ERROR, logger="slotserve"):
            tokens = engine.submit(prompt, params).result().tokens
        assert any("draft model's step failed" in r.getMessage() for r in caplog.records)
        engine.check_integrity()
        assert engine.stats().speculation.drafted > 0  # type: ignore[union-attr]
    with ss.Engine(target, config) as plain:
        assert plain.submit(prompt, params).result().tokens == tokens
