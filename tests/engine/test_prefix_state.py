"""The engine with a prefix cache under random requests (some keeping their completion in
the cache) and cancellations, on a full-attention model and on one with sliding-window
layers, in the cell and the flat layout (hypothesis state machine): engine, pool and cache
invariants hold after every step, nothing stays pinned, finished requests count restored +
computed = prompt, and closing returns the pool to its baseline with the cache emptied."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import slotserve as ss
from slotserve.testing import write_tiny_hf_dir

SYSTEMS = [list(range(3, 3 + n)) for n in (5, 19, 33)]
PROMPT = st.tuples(
    st.integers(0, len(SYSTEMS) - 1), st.lists(st.integers(40, 60), min_size=0, max_size=6)
)


@pytest.fixture(scope="module", params=["llama", "mixed"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    """A full-attention model, and one whose sliding-window layers (a ring of 5) make the
    retention rule refuse token-equal prefixes."""
    kind = request.param
    return ss.load(write_tiny_hf_dir(tmp_path_factory.mktemp("prefix") / kind, kind))


class PrefixEngineMachine(RuleBasedStateMachine):
    model: ss.Model
    layout = "cell"
    max_seqs = 3

    def __init__(self) -> None:
        super().__init__()
        self.engine = ss.Engine(self.model, self.config())
        # A refused submit keeps its place (None): whether the queue had room depends on
        # how far the engine thread got, and the rules a step may draw must not, or
        # hypothesis finds the same draws taking another path (FlakyStrategyDefinition).
        self.handles: list[tuple[ss.RequestHandle | None, int]] = []

    def config(self) -> ss.EngineConfig:
        return ss.EngineConfig(
            kv_layout=self.layout, block_size=4, num_blocks=40, max_seqs=self.max_seqs,
            max_context=64, queue_depth=4, prefill_chunk=8,
            prefix_cache_bytes=12 * 4 * 2 * 2 * 2 * 32 * 4,
        )  # fmt: skip

    @rule(prompt=PROMPT, new=st.integers(1, 8), keep=st.booleans())
    def submit(self, prompt: tuple[int, list[int]], new: int, keep: bool) -> None:
        tokens = SYSTEMS[prompt[0]] + prompt[1]
        params = ss.SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        handle: ss.RequestHandle | None = None
        with contextlib.suppress(ss.AdmissionRefused):
            handle = self.engine.submit(tokens, params, publish_completion=keep)
        self.handles.append((handle, len(tokens)))

    @precondition(lambda self: bool(self.handles))
    @rule(index=st.integers(0, 100), wait=st.booleans())
    def cancel(self, index: int, wait: bool) -> None:
        handle, _ = self.handles[index % len(self.handles)]
        if handle is not None:
            handle.cancel(wait=wait)

    @precondition(lambda self: bool(self.handles))
    @rule()
    def finish_oldest(self) -> None:
        handle, n_prompt = self.handles.pop(0)
        if handle is None:  # refused at submit
            return
        try:
            final = handle.result()
        except ss.AdmissionRefused:
            return
        timings = final.timings
        if final.reason != "cancelled" or timings.prefill_done is not None:
            assert timings.prompt_tokens_restored + timings.prompt_tokens_computed == n_prompt
        assert timings.prompt_tokens_restored == final.usage.cached_tokens < n_prompt

    @invariant()
    def integrity(self) -> None:
        self.engine.check_integrity()
        assert self.engine.prefix is not None and self.engine.prefix.pins == 0

    def teardown(self) -> None:
        self.engine.close()
        self.engine.check_integrity()
        stats = self.engine.stats()
        assert stats.prefix is not None
        assert (stats.kv_blocks_used, stats.prefix.snapshots, stats.slots_in_use) == (0, 0, 0)


@pytest.mark.parametrize(("layout", "max_seqs"), [("cell", 3), ("flat", 3), ("flat", 1)])
def test_prefix_engine_state_machine(model: ss.Model, layout: str, max_seqs: int) -> None:
    """The cell layout shares blocks; the flat one parks finished slots (with one slot,
    every restore takes the parked slot itself)."""
    PrefixEngineMachine.model, PrefixEngineMachine.layout = model, layout
    PrefixEngineMachine.max_seqs = max_seqs
    machine = PrefixEngineMachine.TestCase
    examples = 30 if layout == "cell" else 12  # parked slots: fewer paths than blocks
    machine.settings = settings(max_examples=examples, stateful_step_count=25, deadline=None)
    machine().runTest()
