"""A served set of tiny models under random operation sequences (hypothesis state machine):
submits of every class to every model (an on-demand model loaded on first use, the least
recently used idle one unloaded when the budget needs its room, a load without room
refused with ``model_capacity``), cancels and finishes, with the invariants checked after
every step: the device plan holds the budget, each loaded engine's pool and admission are
whole, no lease or load is left behind, and an interactive step never waited behind more
than one background step of another model (`DeviceScheduler`). Real engines on real tiny
models, each stepping on its own thread and taking turns on the one device scheduler.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import slotserve as ss
from slotserve.engine.device import DeviceScheduler, DeviceSeat
from slotserve.engine.events import PRIORITIES
from slotserve.engine.models import Loaded, ModelSet, ModelSpec
from slotserve.errors import AdmissionRefused
from slotserve.testing import write_tiny_hf_dir

# budget_scope="model": every arena computed (weights at the executor's bytes, KV and
# activations from the config), so the plans, and the budget, are exact.
CONFIG = ss.EngineConfig(
    max_seqs=2, max_context=64, kv_layout="cell", block_size=8, budget_scope="model"
)
KINDS = {"chat": "llama", "a": "qwen2", "b": "qwen3"}
SPECS = [
    ModelSpec("chat", KINDS["chat"]),
    ModelSpec("a", KINDS["a"], resident=False),
    ModelSpec("b", KINDS["b"], resident=False),
]


@functools.cache
def model_dir(kind: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix="slotserve-models-"))
    return write_tiny_hf_dir(root / kind, kind)


def load_tiny(spec: ModelSpec, device: DeviceScheduler) -> Loaded:
    model = ss.load(model_dir(spec.source))
    engine = ss.Engine(model, CONFIG, device=DeviceSeat(device, spec.name))

    def busy() -> bool:
        stats = engine.stats()
        return stats.slots_in_use - stats.slots_parked > 0 or stats.queue_len > 0

    return Loaded(
        engine=engine,
        kind="generate",
        plan_bytes=engine.plan.worst_case_bytes,
        arenas=engine.plan.arenas,
        busy=busy,
        close=engine.close,
    )


@functools.cache
def plan_bytes() -> dict[str, int]:
    """Each model's exact plan (computed arenas only)."""
    device = DeviceScheduler()
    sizes = {}
    for spec in SPECS:
        loaded = load_tiny(spec, device)
        sizes[spec.name] = loaded.plan_bytes
        loaded.close()
    return sizes


class ModelSetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        sizes = plan_bytes()
        # Room for the resident model and one on-demand model at a time, never both.
        self.budget = sizes["chat"] + max(sizes["a"], sizes["b"]) + min(sizes["a"], sizes["b"]) // 2
        self.device = DeviceScheduler(background_min_share=0.5)
        self.models = ModelSet(
            SPECS, lambda spec: load_tiny(spec, self.device), budget=self.budget,
            shared_bytes=lambda: 0,
        )  # fmt: skip
        self.models.start()
        self.handles: list[tuple[str, Any]] = []
        self.refusals: dict[str, int] = {}

    @rule(
        name=st.sampled_from([s.name for s in SPECS]),
        priority=st.sampled_from(PRIORITIES),
        tokens=st.integers(1, 12),
    )
    def submit(self, name: str, priority: str, tokens: int) -> None:
        params = ss.SamplingParams(temperature=0, max_new_tokens=tokens)
        try:
            with self.models.lease(name) as engine:
                handle = engine.submit([5, 6, 7, 8], params, priority=priority)
        except AdmissionRefused as refusal:
            # A model whose room is held by another's requests, or a full engine.
            assert refusal.reason in ("model_capacity", "slots_full", "queue_full"), refusal
            if refusal.reason == "model_capacity":
                assert name != "chat", "the resident model is never refused for room"
                busy = [
                    c for c in self.models.cards() if c["state"] == "loaded" and c["id"] != "chat"
                ]
                assert busy, "refused for room with no other on-demand model loaded"
            self.refusals[refusal.reason] = self.refusals.get(refusal.reason, 0) + 1
            event(f"refused: {refusal.reason}")
            return
        self.handles.append((name, handle))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        _name, handle = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        handle.cancel(wait=True, timeout=30)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        _name, handle = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        final = handle.result()
        assert final.reason in ("length", "stop", "cancelled"), final

    @invariant()
    def plan_holds(self) -> None:
        self.models.check_integrity()  # the device plan within the budget, states whole
        assert self.models.used_bytes <= self.budget

    @invariant()
    def engines_whole(self) -> None:
        for name in self.models.names:
            engine = self.models.engine(name)
            if engine is not None:
                engine.check_integrity()

    @invariant()
    def interactive_never_behind_two_background_steps(self) -> None:
        self.device.check_integrity()

    def teardown(self) -> None:
        try:
            for _, handle in self.handles:
                handle.result()
            for name in self.models.names:  # every slot and block back: nothing leaked
                engine = self.models.engine(name)
                if engine is None:
                    continue
                stats = engine.stats()
                assert stats.slots_in_use == stats.slots_parked, (name, stats)
                assert stats.queue_len == 0
                engine.check_integrity()
            self.models.check_integrity()
            unloads = sum(card["unloads"] for card in self.models.cards())
            event(f"unloads: {min(unloads, 3)}{'+' if unloads > 3 else ''}")
            turns = self.device.counters.turns
            event(f"models stepped: {len(turns)}")
        finally:
            self.models.close()


ModelSetMachine.TestCase.settings = settings(
    max_examples=8,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestModelSet = ModelSetMachine.TestCase
