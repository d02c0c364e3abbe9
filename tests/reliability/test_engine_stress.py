"""The engine under thousands of random operations from several threads, on every layout.

Clients submit (every class, queued or not, with bad input now and then), read part of a
stream, cancel (with and without waiting), drop handles unread, and wait for results, all
at once. Whatever happens, every request ends with exactly one terminal outcome, the
invariants hold while it runs, and closing returns slots, KV blocks and the queue to
baseline.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest

import slotserve as ss
from slotserve.engine.events import PRIORITIES

THREADS = 4
OPERATIONS_PER_THREAD = 250


def _client(engine: ss.Engine, seed: int, outcomes: Counter[str], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    held: list[ss.RequestHandle] = []
    for _ in range(OPERATIONS_PER_THREAD):
        op = rng.random()
        if op < 0.4 or not held:
            outcome = _submit(engine, rng, held)
        elif op < 0.55:
            held.pop(rng.randrange(len(held))).cancel(wait=rng.random() < 0.5)
            outcome = "cancel"
        elif op < 0.65:
            del held[rng.randrange(len(held))]  # dropped unread: the engine reclaims it
            outcome = "drop"
        elif op < 0.8:
            outcome = _read_some(held[rng.randrange(len(held))], rng.randint(1, 3))
        else:
            outcome = _finish(held.pop(rng.randrange(len(held))))
        with lock:
            outcomes[outcome] += 1
    for handle in held:
        handle.cancel()


def _submit(engine: ss.Engine, rng: random.Random, held: list[ss.RequestHandle]) -> str:
    prompt = [rng.randint(3, 250) for _ in range(rng.randint(0 if rng.random() < 0.05 else 1, 40))]
    params = ss.SamplingParams(
        temperature=rng.choice([0.0, 0.8]),
        max_new_tokens=rng.randint(0, 16),
        seed=rng.randint(0, 9),
    )
    try:
        held.append(engine.submit(prompt, params, rng.choice(PRIORITIES), queue=rng.random() < 0.5))
    except ss.AdmissionRefused as refusal:
        return f"refused:{refusal.reason}"
    except ValueError:
        return "bad input"
    return "submitted"


def _read_some(handle: ss.RequestHandle, n: int) -> str:
    try:
        for _, _ in zip(range(n), handle, strict=False):
            pass
    except ss.AdmissionRefused:
        return "refused later"
    return "read"


def _finish(handle: ss.RequestHandle) -> str:
    try:
        return f"finished:{handle.result().reason}"
    except ss.AdmissionRefused as refusal:
        return f"refused later:{refusal.reason}"


@pytest.mark.parametrize("layout", ["flat", "ring", "cell"])
def test_random_operations_from_threads(tiny: ss.Model, layout: str) -> None:
    config: dict[str, Any] = {"kv_layout": layout, "ring_window": 32}
    if layout == "cell":
        config["num_blocks"] = 24  # fewer blocks than max_seqs × max_context: kv_exhausted
    engine = ss.Engine(
        tiny,
        ss.EngineConfig(max_seqs=3, max_context=96, queue_depth=4, queue_timeout_s=0.2, **config),
    )
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    clients = [
        threading.Thread(target=_client, args=(engine, seed, outcomes, lock))
        for seed in range(THREADS)
    ]
    for client in clients:
        client.start()
    while any(client.is_alive() for client in clients):
        engine.check_integrity()  # while it runs, from another thread
        time.sleep(0.05)  # (not a join on one client: once it ends, that would spin)
    for client in clients:
        client.join(60)
        assert not client.is_alive()
    gc.collect()  # dropped handles: their finalizers cancel
    engine.close()
    engine.check_integrity()
    stats = engine.stats()
    assert (stats.slots_in_use, stats.queue_len) == (0, 0)
    assert stats.kv_blocks_used == 0
    assert sum(outcomes.values()) == THREADS * OPERATIONS_PER_THREAD
    assert outcomes["submitted"] > 50 and stats.admitted > 0, outcomes
    # Every accepted request ended exactly once: it finished (ran, or was cancelled while
    # queued) or was refused from the queue later (timeout, close).
    later = stats.refusals.get("queue_timeout", 0) + stats.refusals.get("closed", 0)
    assert sum(stats.finished.values()) + later == outcomes["submitted"], (stats, outcomes)
