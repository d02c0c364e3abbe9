"""The thread governor: one thread while the cores are taken, all of them once they are
free again, probing with a back-off; and a step's results do not depend on it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import slotserve as ss
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.native.contention import GovernorConfig, ThreadGovernor

# Binary fractions, so that sums of windows are exact.
CONFIG = GovernorConfig(window_s=0.125, contended=0.6, probe_s=0.5, max_probe_s=2.0)


@dataclass
class FakeKernel:
    threads: int


def governor() -> tuple[ThreadGovernor, list[FakeKernel]]:
    kernels = [FakeKernel(2), FakeKernel(2)]
    return ThreadGovernor(list(kernels), 2, CONFIG), kernels


def step(g: ThreadGovernor, share: float, seconds: float = 0.125) -> None:
    """``seconds`` of stepping in which the process ran ``share`` of its threads' time."""
    g.observe(seconds, share * seconds * g.threads)


def test_free_cores_keep_every_thread() -> None:
    g, kernels = governor()
    for _ in range(50):
        step(g, 0.95)
    assert g.threads == 2 and [k.threads for k in kernels] == [2, 2] and g.drops == 0


def test_taken_cores_drop_to_one_thread_after_a_window_not_a_step() -> None:
    g, kernels = governor()
    step(g, 0.4, 0.0625)  # half a window: no decision yet
    assert g.threads == 2
    step(g, 0.4, 0.0625)
    assert g.threads == 1 and [k.threads for k in kernels] == [1, 1] and g.drops == 1


def test_probes_back_off_while_taken_and_recover_when_free() -> None:
    g, kernels = governor()
    step(g, 0.4)
    assert g.threads == 1
    waits = []
    for _ in range(3):  # each failed probe doubles the wait: 0.5, 1, 2 s on one thread
        on_one = 0
        while g.threads == 1:
            step(g, 1.0)
            on_one += 1
        waits.append(on_one)
        step(g, 0.45)  # the probe's window: still taken
        assert g.threads == 1
    assert waits == [4, 8, 16] and g.probes == 3 and g.drops == 1
    for _ in range(16):  # at the maximum wait (2 s) the next probe comes
        step(g, 1.0)
    assert g.threads == 2
    step(g, 0.9)  # free: it stays, and the wait resets
    for _ in range(20):
        step(g, 0.9)
    assert g.threads == 2 and [k.threads for k in kernels] == [2, 2]
    step(g, 0.3)
    assert g.threads == 1
    for _ in range(4):
        step(g, 1.0)
    assert g.threads == 2  # probe_s again, not the backed-off wait


def test_one_core_has_nothing_to_govern() -> None:
    kernel = FakeKernel(1)
    g = ThreadGovernor([kernel], 1, CONFIG)
    step(g, 0.1)
    assert g.threads == 1 and g.drops == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"window_s": 0},
        {"contended": 1.0},
        {"contended": 0.0},
        {"probe_s": 0},
        {"probe_s": 4.0, "max_probe_s": 2.0},
    ],
)
def test_config_is_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        GovernorConfig(**bad)


def test_logits_do_not_depend_on_the_thread_count() -> None:
    """What the governor changes, a step's thread count, changes no logit of a step (the
    bundled model on its blocks: prefill, then decode steps)."""
    model = ss.load("bundled", progress=False)
    kernels = [k for k in (model.kernels.blocks, model.kernels.attention) if k is not None]
    assert len(kernels) == 2, "the kernels did not build"
    before = [k.threads for k in kernels]
    ids = model.tokenizer.encode("The capital of France is")
    runs = []
    for threads in (2, 1):
        for kernel in kernels:
            kernel.threads = threads
        try:
            pool = KVPool(
                model.info,
                KVConfig(layout="flat", max_seqs=1, max_context=64),
                attention=model.kernels.attention,
            )
            pool.reserve(0, 64)
            batch = StepBatch.single(0, len(ids))
            pool.begin_step(batch)
            logits = [model.forward(torch.tensor(ids), batch, pool)]
            for position in range(len(ids), len(ids) + 4):
                batch = StepBatch([0], [position], [1])
                pool.begin_step(batch)
                token = int(logits[-1].argmax())
                logits.append(model.forward(torch.tensor([token]), batch, pool))
            runs.append(torch.stack([row.reshape(-1) for row in logits]))
        finally:
            for kernel, threads_before in zip(kernels, before, strict=True):
                kernel.threads = threads_before
    assert torch.equal(runs[0], runs[1])
