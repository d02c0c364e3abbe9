"""The prefix store (the cache's disk tier) over real cell pools without a model: a
restart restores what was written and attends bit for bit as recomputed (every KV dtype,
and a sliding-window ring); each stale or damaged file (truncated, a flipped payload or
header byte, another model, weight format or numerics, a future schema, another KV
layout, a ring past its window) is refused, counted and never served; an unwritable
directory is an error at start; a full disk, a full queue and a dropped snapshot skip the
write and count it; a crash mid-write leaves no torn file; LRU by bytes on disk."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.info import ModelInfo
from slotserve.kv import KVPool
from slotserve.prefix import PrefixCache, PrefixStore, PrefixStoreError, StoreIdentity, store_file
from slotserve.prefix import store as store_module
from slotserve.prefix.store import MAGIC, SUFFIX
from tests.prefix.kvfill import (
    FINGERPRINT,
    FULL,
    WINDOWED,
    identity,
    make_cache,
    make_pool,
    make_store,
    prefill,
)

SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # 11 tokens: ends mid-block


def written(cache: PrefixCache) -> PrefixStore:
    store = cache.store
    assert store is not None
    store.drain()
    store.check_integrity()
    cache.check_integrity()
    cache.pool.check_integrity()
    return store


def restart(
    directory: Path, info: ModelInfo = FULL, dtype: str = "fp32", **options: Any
) -> PrefixCache:
    """A new pool, cache and store over ``directory``: what a new process finds."""
    return make_cache(directory, info, dtype, **options)


def only_file(directory: Path) -> Path:
    (path,) = directory.glob(f"*{SUFFIX}")
    return path


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [("cell", "fp32"), ("cell", "fp16"), ("cell", "bf16"), ("cell", "int8"), ("flat", "fp32")],
)
def test_a_restart_restores_what_was_written_bit_for_bit(
    tmp_path: Path, layout: str, dtype: str
) -> None:
    keep = layout == "flat"  # a flat pool's snapshots are parked slots: released, not published
    cache = make_cache(tmp_path, dtype=dtype, layout=layout)
    assert prefill(cache, 0, [*SYSTEM, 7, 8], keep=keep) == 0
    assert written(cache).report().counters.written == 1
    fresh = restart(tmp_path, dtype=dtype, layout=layout)
    assert len(fresh) == 0 and fresh.store is not None and len(fresh.store) == 1
    # prefill checks the rows computed after the restore against a whole computation
    assert prefill(fresh, 0, [*SYSTEM, 7, 9, 9], keep=keep) == 12
    assert prefill(fresh, 1, [*SYSTEM, 7, 9, 9]) == 13  # from memory now (the last replayed)
    counters = fresh.store.report().counters
    assert (counters.hits, counters.tokens_restored) == (1, 12)
    assert fresh.stats.hits == 2 and fresh.stats.tokens_restored == 25
    written(fresh)


def test_the_ring_layout_restores_a_conversation_past_its_window(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, layout="ring")  # a window of 8 and 2 sinks, every layer
    conversation = [*SYSTEM, 20, 21, 22, 23]  # 15 positions: wrapped
    prefill(cache, 0, conversation)
    written(cache)
    fresh = restart(tmp_path, layout="ring")
    assert prefill(fresh, 0, [*conversation, 24, 25]) == 15
    assert prefill(restart(tmp_path, layout="ring"), 0, [*SYSTEM[:6], 40]) == 0  # refused


def test_a_sliding_window_ring_is_restored_and_its_retention_rule_holds(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, WINDOWED)
    conversation = [*SYSTEM, 20, 21, 22, 23]  # 15 positions: the ring of 6 has wrapped
    prefill(cache, 0, conversation)
    written(cache)
    fresh = restart(tmp_path, WINDOWED)
    # The next turn continues the conversation: its ring still holds what it needs.
    assert prefill(fresh, 0, [*conversation, 24, 25]) == 15
    # A token-equal prefix that stops inside the system prompt: the ring has overwritten
    # it, so the rule refuses it, as it does in memory; computed instead.
    other = restart(tmp_path, WINDOWED)
    assert prefill(other, 0, [*SYSTEM[:8], 40]) == 0
    assert other.store is not None
    assert other.store.report().counters.refused == {"retention": 1}


def _rewrite_header(path: Path, change: dict[str, object], *, resign: bool = True) -> None:
    """Rewrite ``path``'s header with ``change`` applied (re-signed, so only the change is
    wrong)."""
    import hashlib

    raw = path.read_bytes()
    length = int.from_bytes(raw[len(MAGIC) : len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    header = json.loads(raw[start : start + length])
    header.pop("header_sha256")
    for key, value in change.items():
        target, *path_keys = key.split(".")
        node = header
        for part in [target, *path_keys][:-1]:
            node = node[part]
        node[[target, *path_keys][-1]] = value
    if resign:
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        header["header_sha256"] = hashlib.sha256(canonical).hexdigest()
    encoded = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(MAGIC + len(encoded).to_bytes(8, "little") + encoded + raw[start + length :])


def _flip(path: Path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(raw))


def _token_flip(path: Path) -> None:
    raw = path.read_bytes()
    at = raw.index(b'"tokens":[3,') + len(b'"tokens":[')
    path.write_bytes(raw[:at] + b"8" + raw[at + 1 :])  # token 3 reads 8: same length


def _header_change(change: dict[str, object], resign: bool = True) -> object:
    return lambda path: _rewrite_header(path, change, resign=resign)


CORRUPTIONS = {
    "truncated": ("checksum", lambda p: p.write_bytes(p.read_bytes()[:-100])),
    "appended": ("checksum", lambda p: p.write_bytes(p.read_bytes() + b"\0")),
    "header byte": ("checksum", _token_flip),
    "another model": ("model", _header_change({"fingerprint.model_sha256": "b" * 64})),
    "another weight format": ("model", _header_change({"fingerprint.weight_format": "x"})),
    "other numerics": ("numerics", _header_change({"fingerprint.numerics": "numerics-2"})),
    "a future schema": ("schema", _header_change({"schema": 99}, resign=False)),
    "not a store file": ("schema", lambda p: p.write_bytes(b"GGUF" + bytes(64))),
    "another KV dtype": ("layout", _header_change({"kv.dtype": "fp16"})),
    "a retention state": ("retention", _header_change({"retention.high_water": 3})),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_each_stale_or_damaged_file_is_refused_at_start_and_counted(
    tmp_path: Path, case: str
) -> None:
    reason, corrupt = CORRUPTIONS[case]
    cache = make_cache(tmp_path)
    prefill(cache, 0, [*SYSTEM, 7])
    path = only_file(written(cache).directory)
    corrupt(path)
    fresh = restart(tmp_path)
    assert fresh.store is not None
    assert fresh.store.report().counters.refused == {reason: 1}
    assert len(fresh.store) == 0
    assert prefill(fresh, 0, [*SYSTEM, 7, 1]) == 0  # never served: computed instead
    assert path.exists() == (reason != "checksum")  # damaged files go; others stay theirs
    written(fresh)


def test_a_flipped_payload_byte_is_refused_at_restore_and_nothing_is_served(
    tmp_path: Path,
) -> None:
    cache = make_cache(tmp_path)
    prefill(cache, 0, [*SYSTEM, 7])
    path = only_file(written(cache).directory)
    _flip(path, 5)  # inside the last part: found only once the whole payload is read
    fresh = restart(tmp_path)
    assert fresh.store is not None and len(fresh.store) == 1  # its header is sound
    assert prefill(fresh, 0, [*SYSTEM, 7, 1]) == 0  # refused while read: computed instead
    assert fresh.store.report().counters.refused == {"checksum": 1}
    assert not path.exists() and fresh.stats.misses == 1
    assert fresh.pool.session_ids() == {0}
    written(fresh)


def test_another_model_fingerprint_never_sees_the_files(tmp_path: Path) -> None:
    cache = make_cache(tmp_path)
    prefill(cache, 0, [*SYSTEM, 7])
    written(cache)
    pool = make_pool()
    for change in ({"model_sha256": "c" * 64}, {"numerics": "n2"}, {"weight_format": "eager:x"}):
        other = StoreIdentity(
            dataclasses.replace(FINGERPRINT, **change), pool.kv_identity(),
            tuple(pool.payload_parts()),
        )  # fmt: skip
        store = PrefixStore(tmp_path, 1 << 20, other, pool.retains_from, writer=False)
        assert len(store) == 0 and sum(store.report().counters.refused.values()) == 1
    layout = make_pool(dtype="fp16")
    store = PrefixStore(tmp_path, 1 << 20, identity(layout), layout.retains_from, writer=False)
    assert store.report().counters.refused == {"layout": 1}
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1  # left for the model that wrote it


def test_a_directory_that_cannot_be_written_is_an_error_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(PrefixStoreError, match="not a directory this process can write"):
        make_store(a_file / "store", make_pool())
    real_open = os.open

    def denied(path: object, *args: object, **kwargs: object) -> int:
        if ".tmp-probe" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(PrefixStoreError, match="Permission denied"):
        make_store(tmp_path / "store", make_pool())


def test_a_full_disk_skips_the_write_counts_it_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(tmp_path)
    real_write = store_file.write_file

    def full(path: Path, header: object, payload: object) -> str:
        path.write_bytes(b"partial")  # what a write that ran out of space leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "write_file", full)
    prefill(cache, 0, [*SYSTEM, 7])
    store = written(cache)  # check_integrity: no temporary file left
    assert store.report().counters.skipped == {"disk_full": 1} and len(store) == 0
    monkeypatch.setattr(store_module, "write_file", real_write)
    prefill(cache, 1, [*SYSTEM, 8])  # space again: the next one is written
    assert len(written(cache)) == 1


def test_a_full_queue_and_a_dropped_snapshot_skip_the_write(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, queue_size=1)
    prefill(cache, 0, [1, 2, 3, 4, 5])
    prefill(cache, 1, [6, 7, 8, 9, 10])  # the queue holds one: skipped, never waited for
    assert cache.store is not None
    assert cache.store.report().counters.skipped == {"queue_full": 1}
    cache.pool.release(0)
    cache.pool.release(1)
    cache.evict_one()  # the queued snapshot is dropped before the writer copied it
    store = written(cache)
    assert store.report().counters.skipped == {"queue_full": 1, "dropped": 1}
    assert len(store) == 0


def test_a_crash_mid_write_leaves_no_torn_file(tmp_path: Path) -> None:
    cache = make_cache(tmp_path)
    prefill(cache, 0, [*SYSTEM, 7])
    good = only_file(written(cache).directory)
    before = good.read_bytes()
    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from slotserve.prefix import store
from tests.prefix.kvfill import make_cache, prefill
def crash(path, header, payload):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, store.MAGIC + bytes(next(iter(payload))))  # then the process dies
    os._exit(9)
store.write_file = crash
cache = make_cache({str(tmp_path)!r})
prefill(cache, 0, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 7, 1, 2])
cache.store.drain()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 9, result.stderr.decode()
    assert len(list(tmp_path.glob(".tmp-*"))) == 1  # the torn write, under its temporary name
    assert [p.name for p in tmp_path.glob(f"*{SUFFIX}")] == [good.name]
    fresh = restart(tmp_path)
    assert fresh.store is not None
    report = fresh.store.report()
    assert (report.files, report.counters.torn_removed, report.counters.refused) == (1, 1, {})
    assert good.read_bytes() == before
    assert prefill(fresh, 0, [*SYSTEM, 7, 1, 2]) == 12  # the good file still serves
    written(fresh)


def test_lru_by_bytes_on_disk_survives_a_restart(tmp_path: Path) -> None:
    cache = make_cache(tmp_path)
    prefill(cache, 0, [10, 1, 2, 3, 4, 5, 6])
    size = only_file(written(cache).directory).stat().st_size
    cache = make_cache(tmp_path, budget=2 * size + size // 2)  # room for two files
    for session, first in enumerate((20, 30), start=1):
        prefill(cache, session, [first, 1, 2, 3, 4, 5, 6])
        written(cache)
    store = written(cache)
    assert len(store) == 2 and store.report().counters.evictions == 1
    assert [e.tokens[0] for e in store.entries()] == [20, 30]
    # A hit on the older file makes it the most recently used, on disk too.
    fresh = restart(tmp_path, budget=2 * size + size // 2)
    assert fresh.bind(0, [20, 1, 2, 3, 4, 5, 6, 9], 12) == 7
    fresh.pool.release(0)
    written(fresh)
    fresh = restart(tmp_path, budget=2 * size + size // 2)
    assert fresh.store is not None
    assert [e.tokens[0] for e in fresh.store.entries()] == [30, 20]
    assert fresh.store.nbytes <= fresh.store.budget_bytes


def test_a_longer_snapshot_replaces_the_file_it_extends(tmp_path: Path) -> None:
    cache = make_cache(tmp_path)
    prefill(cache, 0, [*SYSTEM, 7])
    written(cache)
    prefill(cache, 1, [*SYSTEM, 7, 8, 9], keep=True)
    store = written(cache)
    assert [len(e.tokens) for e in store.entries()] == [14]
    assert store.report().counters.covered == 1


def test_a_window_keeps_a_shorter_file_its_longer_one_cannot_serve(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, WINDOWED)
    prefill(cache, 0, SYSTEM)  # 11 positions
    written(cache)
    prefill(cache, 1, [*SYSTEM, 7, 8, 9, 10, 11])  # its ring no longer holds the system prompt
    store = written(cache)
    assert sorted(len(e.tokens) for e in store.entries()) == [11, 16]


def test_a_shorter_file_serves_where_the_rule_refuses_a_longer_one(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, WINDOWED)  # layer 1: a ring of 6
    prefill(cache, 0, [3, 4, 5, 20, 20], keep=True)  # never wrapped
    written(cache)
    fresh = restart(tmp_path, WINDOWED)
    prefill(fresh, 0, [3, 4, 5, 20, 20, 20, 20], keep=True)  # wrapped: it cannot serve 5
    store = written(fresh)
    assert sorted(len(e.tokens) for e in store.entries()) == [5, 7]
    # Both share the prompt's first 5 tokens; the longer, wrapped one is refused at 5, the
    # shorter one restores them: no restore lost, so no refusal counted.
    again = restart(tmp_path, WINDOWED)
    assert prefill(again, 0, [3, 4, 5, 20, 20, 20]) == 5
    assert again.store is not None and again.store.report().counters.refused == {}


def test_trie_reach_lists_each_key_at_the_depth_it_leaves_the_path() -> None:
    from slotserve.prefix import TokenTrie

    trie = TokenTrie()
    trie.insert(1, [1, 2, 3])
    trie.insert(2, [1, 2, 3, 4, 5])
    trie.insert(3, [1, 9])
    trie.insert(4, [7])
    assert trie.reach([1, 2, 3, 4, 6]) == [(4, {2}), (3, {1}), (1, {3})]
    assert trie.reach([8]) == []


@pytest.mark.skipif(sys.platform != "linux", reason="threads have their own nice on Linux")
def test_the_writer_thread_yields_to_the_engine(tmp_path: Path) -> None:
    store = make_store(tmp_path, make_pool(), writer=True)
    try:
        assert store._thread is not None and store._thread.native_id is not None
        tid = store._thread.native_id
        for _ in range(1000):  # it sets its own priority as it starts
            if os.getpriority(os.PRIO_PROCESS, tid) >= store_module.WRITER_NICE:
                break
            time.sleep(0.001)
        assert os.getpriority(os.PRIO_PROCESS, tid) >= store_module.WRITER_NICE
    finally:
        store.close()


def test_the_writer_holds_one_part_of_a_snapshot_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer copies a snapshot out of the pool a part at a time, writing each before
    it asks for the next: it never holds a copy of the whole snapshot, which the memory
    plan does not count (it held all of it before the header went in twice)."""
    alive: set[int] = set()
    most = [0]
    real = KVPool.read_payload

    def counted(pool: KVPool, payload: Any) -> Iterator[torch.Tensor]:
        for i, part in enumerate(real(pool, payload)):
            most[0] = max(most[0], len(alive))  # parts still held when the next is copied
            alive.add(i)
            weakref.finalize(part, alive.discard, i)
            yield part

    monkeypatch.setattr(KVPool, "read_payload", counted)
    cache = make_cache(tmp_path, WINDOWED)
    prefill(cache, 0, [*SYSTEM, 7])
    store = written(cache)
    (entry,) = store.entries()
    assert len(entry.parts) >= 4
    assert most[0] <= 1, f"{most[0]} parts held at once"
    fresh = restart(tmp_path, WINDOWED)
    assert prefill(fresh, 0, [*SYSTEM, 7, 1]) == len(SYSTEM) + 1  # and it restores
    written(fresh)


@pytest.mark.parametrize("layout", ["flat", "cell", "ring"])
def test_a_pool_on_the_meta_device_has_the_store_identity_of_a_real_one(layout: str) -> None:
    """`slotserve plan --prefix-store` reads the store's identity off a pool on the meta
    device (shapes and dtypes, no memory): it must be the identity serve's real pool has,
    or the plan would survey files serve refuses (or the reverse)."""
    from slotserve.info import ModelInfo
    from slotserve.kv import KVConfig, KVPool

    info = ModelInfo(
        arch="gemma3", n_layers=4, dim=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
        vocab_size=64, max_context=256, sliding_window=(8, None, 8, None),
    )  # fmt: skip
    config = KVConfig(layout=layout, max_seqs=3, max_context=64, dtype="int8", ring_window=16)
    real = KVPool(info, config)
    with torch.device("meta"):
        shapes = KVPool(info, config)
    assert shapes.groups[0].keys[0].data.device.type == "meta"
    assert shapes.kv_identity() == real.kv_identity()
    assert shapes.payload_parts() == real.payload_parts()
