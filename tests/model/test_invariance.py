"""Exactness: a request's logits do not depend on what it is batched with, how its prompt
is chunked, or whether its prefix was restored from a clone, for GGUF block weights on the
compiled kernels. Each request's logits, position by position, are `torch.equal` to the same
request run alone in one chunk, for every layout and KV dtype, and for a model that mixes
sliding-window and full-attention layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.errors import SessionError
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.testing import write_tiny_gguf

CONTEXT = 48
# (layout, ring window, sinks): flat and cell keep every position; ring keeps a window and
# sinks (StreamingLLM), shorter than the requests, so the rings wrap mid-request.
LAYOUTS = [("flat", 1024, 0), ("cell", 1024, 0), ("ring", 9, 2)]
Layout = tuple[str, int, int]
Schedule = tuple[list[list[int]], list[list[tuple[int, int]]]]


@pytest.fixture(scope="module", params=["Q8_0", "Q4_1"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ss.Model:
    path = write_tiny_gguf(tmp_path_factory.mktemp("inv") / "tiny.gguf", qtype=request.param)
    loaded = ss.load(path, weights="gguf", progress=False)
    assert loaded.halves.kind == "block" and loaded.kernels.attention is not None
    return loaded


def windowed(model: ss.Model) -> ss.Model:
    """The same weights with layers 1 and 3 attending over a window of 5 (ring storage)."""
    assert model.weights is not None
    info = dataclasses.replace(model.info, sliding_window=(None, 5, None, 5))
    return ss.Model.from_weights(info, model.tokenizer, model.weights, "", model.kernels)


def pool_for(model: ss.Model, layout: Layout, dtype: str, seqs: int) -> KVPool:
    kind, window, sinks = layout
    config = KVConfig(
        layout=kind, max_seqs=seqs, max_context=CONTEXT, block_size=4, dtype=dtype,
        ring_window=window, sinks=sinks,
    )  # fmt: skip
    return KVPool(model.info, config, attention=model.kernels.attention)


def alone(model: ss.Model, layout: Layout, dtype: str, ids: list[int]) -> torch.Tensor:
    """``ids`` as one request, in one chunk, in a pool of its own."""
    pool = pool_for(model, layout, dtype, 1)
    pool.reserve(0, len(ids))
    batch = StepBatch.single(0, len(ids))
    pool.begin_step(batch)
    return model.forward(torch.tensor(ids), batch, pool, all_logits=True)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """Requests (token ids), and steps: each step a list of (request, tokens to add)."""
    count = draw(st.integers(1, 3))
    requests = [draw(st.lists(st.integers(3, 250), min_size=2, max_size=30)) for _ in range(count)]
    done, steps = [0] * count, []
    while any(d < len(r) for d, r in zip(done, requests, strict=True)):
        live = [i for i, r in enumerate(requests) if done[i] < len(r)]
        chosen = draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        step = []
        for i in sorted(chosen):
            n = draw(st.integers(1, len(requests[i]) - done[i]))
            step.append((i, n))
            done[i] += n
        steps.append(step)
    return requests, steps


def run_schedule(model: ss.Model, layout: Layout, dtype: str, case: Schedule) -> list[torch.Tensor]:
    """Every request's logits, driven through the steps of ``case`` in one pool."""
    requests, steps = case
    pool = pool_for(model, layout, dtype, len(requests))
    for i, ids in enumerate(requests):
        pool.reserve(i, len(ids))
    done = [0] * len(requests)
    got: list[list[torch.Tensor]] = [[] for _ in requests]
    for step in steps:
        batch = StepBatch([i for i, _ in step], [done[i] for i, _ in step], [n for _, n in step])
        pool.begin_step(batch)
        tokens = torch.tensor([t for i, n in step for t in requests[i][done[i] : done[i] + n]])
        logits = model.forward(tokens, batch, pool, all_logits=True)
        row = 0
        for i, n in step:
            got[i].append(logits[row : row + n])
            row += n
            done[i] += n
        pool.check_integrity()
    return [torch.cat(parts) for parts in got]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("mixed", [False, True], ids=["full", "sliding"])
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=schedules())
def test_logits_do_not_depend_on_the_batch(
    model: ss.Model, layout: Layout, dtype: str, mixed: bool, case: Schedule
) -> None:
    subject = windowed(model) if mixed else model
    batched = run_schedule(subject, layout, dtype, case)
    for ids, logits in zip(case[0], batched, strict=True):
        assert torch.equal(logits, alone(subject, layout, dtype, ids))


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=[x[0] for x in LAYOUTS[1:]])
def test_a_restored_prefix_gives_the_recomputed_logits(model: ss.Model, layout: Layout) -> None:
    """A clone of a session's first positions (cell blocks shared copy-on-write, ring rows
    copied), then the suffix: bit for bit what computing the whole prompt gives; a clone the
    rings no longer hold is refused by the retention rule."""
    for subject in (model, windowed(model)):
        ids = list(range(5, 5 + 30))
        pool = pool_for(subject, layout, "fp16", 3)
        pool.reserve(0, len(ids))
        first = StepBatch.single(0, 12)
        pool.begin_step(first)
        subject.forward(torch.tensor(ids[:12]), first, pool, all_logits=True)
        for upto in (12, 8) if layout[0] == "cell" else (12,):
            if upto < 12 and any(w is not None for w in subject.info.sliding_window):
                # the window's rings hold positions 7..11 only
                with pytest.raises(SessionError, match="left the ring"):
                    pool.clone(0, upto)
                continue
            clone = pool.clone(0, upto)
            pool.extend(clone, len(ids) - upto)
            batch = StepBatch([clone], [upto], [len(ids) - upto])
            pool.begin_step(batch)
            suffix = subject.forward(torch.tensor(ids[upto:]), batch, pool, all_logits=True)
            assert torch.equal(suffix, alone(subject, layout, "fp16", ids)[upto:])
            pool.release(clone)
        pool.check_integrity()
