"""Streaming events, batched correctness, seeds, stop strings, async iteration."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import pytest

import slotserve as ss
from slotserve.engine.probe import teacher_forced_logits

GREEDY = ss.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


def reference_greedy(model: ss.Model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(teacher_forced_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_event_stream_shape(make_engine: Any) -> None:
    engine = make_engine(max_seqs=2, max_context=256)
    events = list(engine.submit([5, 6, 7], GREEDY))
    tokens = [e for e in events if isinstance(e, ss.TokenEvent)]
    assert [e.index for e in tokens if e.token_id >= 0] == list(range(16))
    assert isinstance(events[-1], ss.Finished)
    assert sum(isinstance(e, ss.Finished) for e in events) == 1
    final = events[-1]
    assert final.reason == "length" and final.usage == ss.Usage(3, 16)
    assert "".join(e.text for e in tokens) == final.text
    assert all(a.time <= b.time for a, b in itertools.pairwise(tokens))
    timings = final.timings
    assert timings.ttft is not None and timings.queue_time is not None
    assert len(timings.itl) == 15 and timings.prompt_tokens_computed == 3


def test_concurrent_requests_equal_each_alone(make_engine: Any, tiny: ss.Model) -> None:
    engine = make_engine(max_seqs=4, max_context=256, kv_layout="cell", prefill_chunk=5)
    prompts = [[5, 6, 7], list(range(10, 30)), [40], list(range(50, 62))]
    handles = [engine.submit(p, GREEDY) for p in prompts]
    for prompt, handle in zip(prompts, handles, strict=True):
        assert list(handle.result().tokens) == reference_greedy(tiny, prompt, 16)


def test_bundled_batched_greedy_matches_single(bundled: ss.Model, make_engine: Any) -> None:
    engine = make_engine(bundled, max_seqs=3, max_context=512, kv_layout="cell")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = ss.SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    together = [engine.submit(p, params) for p in prompts]
    results = [h.result().tokens for h in together]
    alone = [engine.submit(p, params).result().tokens for p in prompts]
    assert results == alone
    assert results[0][:4] == (7042, 30, 198, 198)  # llama.cpp's " Paris.\n\n"


def test_same_seed_same_tokens_under_concurrency(make_engine: Any) -> None:
    engine = make_engine(max_seqs=4, max_context=256)
    params = ss.SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=20)
    handles = [engine.submit([5, 6, 7], params) for _ in range(3)]
    results = {h.result().tokens for h in handles}
    assert len(results) == 1
    other = engine.submit([5, 6, 7], ss.SamplingParams(temperature=1.0, seed=99, max_new_tokens=20))
    assert other.result().tokens not in results


def test_stop_string_is_never_streamed(bundled: ss.Model, make_engine: Any) -> None:
    engine = make_engine(bundled, max_seqs=2, max_context=512)
    prompt = "The capital of France is"
    free = engine.submit(prompt, ss.SamplingParams(temperature=0, max_new_tokens=24)).result()
    stop = free.text[12:18]  # a stop string that greedy decoding is bound to meet
    assert len(stop) == 6
    handle = engine.submit(
        prompt, ss.SamplingParams(temperature=0, max_new_tokens=24, stop=(stop,))
    )
    events = list(handle)
    streamed = "".join(e.text for e in events if isinstance(e, ss.TokenEvent))
    assert streamed == free.text[: free.text.index(stop)]
    assert events[-1].reason == "stop"  # type: ignore[union-attr]


def test_async_iteration(make_engine: Any) -> None:
    engine = make_engine(max_seqs=2, max_context=256)

    async def consume() -> list[object]:
        return [event async for event in engine.submit([5, 6], GREEDY)]

    events = asyncio.run(consume())
    assert isinstance(events[-1], ss.Finished) and len(events) == 17


def test_submit_and_cancel_from_many_threads(make_engine: Any) -> None:
    engine = make_engine(max_seqs=4, max_context=256, queue_depth=16, kv_layout="cell")
    outcomes: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        handle = engine.submit([5 + i, 6], ss.SamplingParams(max_new_tokens=30, seed=i))
        if i % 2:
            handle.cancel()
        reason = handle.result().reason
        with lock:
            outcomes.append(reason)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 12
    assert outcomes.count("cancelled") >= 1
    engine.check_integrity()
    assert engine.stats().slots_in_use == 0


def test_max_new_tokens_zero_and_bad_input(make_engine: Any) -> None:
    engine = make_engine(max_seqs=2, max_context=256)
    final = engine.submit([5, 6], ss.SamplingParams(max_new_tokens=0)).result()
    assert final.reason == "length" and final.tokens == ()
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], GREEDY)
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.submit([10**6], GREEDY)
    with pytest.raises(ValueError, match="priority"):
        engine.submit([5], GREEDY, priority="urgent")
    assert engine.stats().slots_in_use == 0
