"""Scheduler invariants over random sets of running requests (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import slotserve as ss
from slotserve.engine.admission import build_request
from slotserve.engine.events import PRIORITIES
from slotserve.engine.scheduler import Scheduler

REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(PRIORITIES),
        st.integers(1, 60),  # prompt length
        st.integers(0, 60),  # prompt tokens already prefilled (clamped)
        st.booleans(),  # cancelled
    ),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(
    REQUESTS,
    st.sampled_from(["isolate", "fifo"]),
    st.integers(8, 64),
    st.integers(1, 32),
    st.integers(1, 8),
    st.booleans(),
)
def test_select_respects_every_limit(
    tiny: ss.Model,
    specs: list[tuple[str, int, int, bool]],
    policy: str,
    max_batch_tokens: int,
    prefill_chunk: int,
    max_batch: int,
    pressed: bool,
) -> None:
    """Every limit holds; under pressure no background request steps and the batch is
    at most half of ``max_batch`` (at least one)."""
    config = ss.EngineConfig(
        max_seqs=8,
        max_context=256,
        policy=policy,
        max_batch_tokens=max_batch_tokens,
        prefill_chunk=prefill_chunk,
    )
    running = []
    for i, (priority, length, done, cancelled) in enumerate(specs):
        request = build_request(
            i,
            tiny,
            config,
            list(range(3, 3 + length)),
            ss.SamplingParams(max_new_tokens=8),
            priority,
            now=0.0,
        )
        request.state = "running"
        request.prefilled = min(done, length)
        if cancelled:
            request.cancelled.set()
        running.append(request)
    work = Scheduler(config, lambda: pressed).select(running, max_batch)
    chosen = [r for r, _ in work]
    limit = max(1, max_batch // 2) if pressed else max_batch
    assert len(chosen) == len({r.request_id for r in chosen}) <= limit
    assert sum(n for _, n in work) <= max_batch_tokens
    for request, n in work:
        assert not request.cancelled.is_set()
        if request.in_prefill:
            assert 1 <= n <= min(prefill_chunk, len(request.prompt) - request.prefilled)
        else:
            assert n == 1
    ready = [r for r in running if not r.cancelled.is_set()]
    if pressed:
        assert all(r.priority != "background" for r in chosen)
        ready = [r for r in ready if r.priority != "background"]  # paused, not ready
    if policy == "isolate" and work:
        classes = {r.priority for r in chosen}
        assert len(classes) == 1
        best = min(PRIORITIES.index(r.priority) for r in ready)
        assert PRIORITIES.index(classes.pop()) == best  # no minimum share configured
    if ready and not work:
        raise AssertionError("ready work but an empty step")
    decodes = [r for r in ready if not r.in_prefill]
    if policy == "fifo":
        assert sum(1 for r in chosen if not r.in_prefill) == min(len(decodes), limit)
