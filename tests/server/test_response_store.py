"""The Responses API's `ResponseStore`: bounded by count and by the bytes its responses
hold (least recently used dropped first, a response larger than the budget never kept),
and that budget counted in the memory plan when a server starts (`http.serve.CancellingServer`)."""

from __future__ import annotations

import sys

import pytest

from slotserve.server.responses.store import ResponseStore, StoredResponse, held_bytes

MIB = 2**20


def stored(text: str, metadata: dict[str, str] | None = None) -> StoredResponse:
    conversation = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return StoredResponse(conversation, {"id": "resp", "metadata": metadata or {}})


def test_held_bytes_counts_every_object_once() -> None:
    text = "x" * 100_000
    assert held_bytes(text) == sys.getsizeof(text)
    shared = held_bytes([text, {"a": text}])  # the string counted once
    assert sys.getsizeof(text) < shared < 2 * sys.getsizeof(text)
    one = stored(text).held_bytes()
    assert sys.getsizeof(text) < one < sys.getsizeof(text) + 4096


def test_the_store_is_bounded_in_bytes_oldest_dropped_first() -> None:
    """256 responses of ~0.9 MB each held 231 MB: now they hold at most the budget."""
    store = ResponseStore(size=256, budget_bytes=4 * MIB)
    big = {f"k{i}": "v" * 60_000 for i in range(15)}  # ~0.9 MB, as the issue measured
    for index in range(256):
        assert store.put(f"resp_{index}", stored(f"turn {index}", {**big, "n": str(index)}))
        store.check_integrity()
    assert store.held_bytes <= 4 * MIB and 0 < len(store) < 256
    assert store.get("resp_255") is not None and store.get("resp_0") is None
    kept = len(store)
    # A read makes a response the most recently used: the next put drops another.
    oldest = f"resp_{256 - kept}"
    assert store.get(oldest) is not None
    store.put("resp_new", stored("new", big))
    assert store.get(oldest) is not None and store.get(f"resp_{257 - kept}") is None
    store.check_integrity()


def test_a_response_larger_than_the_budget_is_not_kept() -> None:
    store = ResponseStore(size=4, budget_bytes=MIB)
    assert store.put("small", stored("a"))
    assert not store.put("huge", stored("x" * (2 * MIB)))
    assert store.get("huge") is None and store.get("small") is not None  # nothing dropped
    store.check_integrity()


def test_putting_an_id_again_recharges_it() -> None:
    store = ResponseStore(size=4, budget_bytes=MIB)
    store.put("r", stored("x" * 100_000))
    store.put("r", stored("y"))
    assert len(store) == 1 and store.held_bytes < 10_000
    store.check_integrity()
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        ResponseStore(budget_bytes=-1)
