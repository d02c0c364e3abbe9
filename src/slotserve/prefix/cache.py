"""`PrefixCache`: immutable KV snapshots of completed prefills, reused by later requests.

It owns the snapshots it published in the pool (`KVPool.publish`: slotless, read-only,
blocks shared by refcount), a `TokenTrie` over their tokens for longest-match, an LRU order
and a byte budget on the blocks they pin. It binds new requests (`bind`): the longest usable
prefix is restored into the request's own session copy-on-write and the rest is reserved
fresh, evicting snapshots while the pool lacks room (last of all the matched snapshot
itself, consumed by the restore). A finished request may hand its KV over (`release_into`):
its prompt and completion become a snapshot, so the next turn of a conversation restores
them. A new snapshot replaces those whose tokens it extends. It never touches the step. In a
pool that parks slots (the flat layout, `KVPool.parks_slots`) a snapshot is a finished
session's parked slot and nothing else: `publish` declines (a running session's rows could
only be copied out of the pool), and a bind that finds no free slot evicts parked ones,
last of all consuming its own match, whose slot the request then takes with its rows in
place (llama.cpp's slots keep their last prompt the same way).

Validity. A snapshot serves a prefix only if every layer still holds what the suffix
needs (`KVPool.retains`): token equality is not enough. Cell layers keep every position. A
sliding-window layer (or any layer of the ring layout) keeps a ring of its last ``window``
positions (and its sinks), so a snapshot written up to position ``h`` serves a prefix ``p``
only if its ring never wrapped or ``p >= h - 1`` (a
conversation's next turn, a repeated prompt); a token-equal prefix that diverges earlier is
rejected, counted in ``stats.rejections`` (by rule), and computed instead. Anything else that
changes KV contents (weights, their format, KV dtype, rope settings) is fixed for the life
of one pool and one engine, and a cache lives and dies with its engine's pool: snapshots
in memory never cross a change of those (the disk tier's files carry them in a
fingerprint, checked before a file is served).

Disk tier. With a `PrefixStore`, the snapshots likely to be used again are offered to the
store (written by its thread; the offer's ticket is cancelled when the snapshot is
dropped): a finished request's prompt and completion (`release_into`: a conversation's
latest turn, which its next turn extends) at once, and a prompt snapshot (`publish`) once
it is hit (at once with ``write_prompts``); one that is never used again is never written,
and a turn that a next turn extends before the writer reached it is superseded, not
written. And
`bind` also asks the store: a stored snapshot that restores more of the prompt than memory
does is read into the request's own fresh reservation (`KVPool.load_payload`), its
checksum checked as it is read: a file that fails commits nothing, and the memory match,
if any, is used instead. `bind_deferring` leaves that read out of the bind, so that it
happens without the engine lock (`read`, then `finish`). Closing waits for queued writes
first.

Locking: not thread-safe. The engine uses its cache only under the engine lock (admission,
publication after a step, close), like the pool itself, except `read`: it touches only the
store (its own lock) and the pending session's own cells (`KVPool.write_payload`), which
the engine neither steps nor releases until `finish`.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from slotserve.errors import KVExhausted
from slotserve.kv.pool import KVPool
from slotserve.prefix.store import PrefixStore, StoreMatch, WriteTicket
from slotserve.prefix.trie import TokenTrie

RING_WRAPPED_RULE = "ring_wrapped"
CLOSE_FLUSH_S = 10.0  # at close, how long queued writes to the store may take


@dataclass
class PrefixCounters:
    """Monotone counters of one cache. ``rejections``: admissions whose token-equal
    prefixes a retention rule refused (``rejections_by_rule``: by rule; the one rule today
    is ``ring_wrapped``: a ring, of a sliding-window layer or the ring layout, that has
    wrapped past what the prefix needs)."""

    hits: int = 0
    misses: int = 0
    rejections: int = 0
    rejections_by_rule: Counter[str] = field(default_factory=Counter)
    tokens_restored: int = 0
    published: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class PendingRestore:
    """A session bound with a fresh reservation for ``n_tokens`` positions that the stored
    snapshot ``match`` is to fill (`PrefixCache.bind_deferring`): `PrefixCache.read` it
    (without the engine lock), then `PrefixCache.finish` it (under the lock)."""

    session: int
    tokens: tuple[int, ...]
    n_tokens: int
    match: StoreMatch


@dataclass
class Snapshot:
    """One published snapshot: pool snapshot ``key`` holding ``tokens``' KV. ``pins``
    counts the restores in progress from it (it is never evicted while pinned)."""

    key: int
    tokens: tuple[int, ...]
    pins: int = 0
    offered: bool = False  # to the disk tier (`PrefixCache._offer`)


class PrefixCache:
    """Snapshots of prompts in one pool, under a byte budget. See the module docstring."""

    def __init__(
        self,
        pool: KVPool,
        budget_bytes: int,
        store: PrefixStore | None = None,
        *,
        write_prompts: bool = False,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"prefix cache budget_bytes={budget_bytes} must be > 0")
        if not pool.supports_snapshots:
            raise ValueError("the prefix cache needs a pool with layers")
        self.pool, self.budget_bytes = pool, budget_bytes
        self.store, self.write_prompts = store, write_prompts
        self.stats = PrefixCounters()
        self._tickets: dict[int, WriteTicket] = {}  # snapshot → its write to the store
        self._entries: OrderedDict[int, Snapshot] = OrderedDict()  # least recently used first
        self._trie = TokenTrie()
        self._block_holders: Counter[int] = Counter()  # block → snapshots holding it
        self._keys = itertools.count(-1, -1)  # pool ids below 0: never a request's id

    # -- reads -----------------------------------------------------------------------

    @property
    def bytes_pinned(self) -> int:
        """Bytes of the distinct blocks the snapshots hold (a block shared by several
        snapshots, or with running requests, counts once), and of their copies of ring
        rows (sliding-window layers, the ring layout). A parked slot (`KVPool.parks_slots`)
        adds nothing: its rows are the pool's own, and it is dropped before a request waits."""
        copies = sum(self.pool.snapshot_copied_nbytes(k) for k in self._entries)
        return len(self._block_holders) * self.pool.block_nbytes + copies

    def _too_big(self, n_tokens: int) -> bool:
        """Whether one snapshot of ``n_tokens`` alone would pass the budget."""
        blocks = -(-n_tokens // self.pool.config.block_size)
        size = blocks * self.pool.block_nbytes + self.pool.snapshot_copy_nbytes
        return size > self.budget_bytes

    @property
    def pins(self) -> int:
        return sum(e.pins for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    # -- binding a request -----------------------------------------------------------

    def bind(self, session: int, tokens: Sequence[int], n_tokens: int) -> int:
        """Reserve ``session`` for ``n_tokens`` positions, its first positions restored from
        the longest usable snapshot of ``tokens``; returns how many were restored (0 on a
        miss). At most ``len(tokens) - 1`` are restored, so the last prompt token is always
        computed again and its logits are fresh (stored logits are never served). While the
        pool lacks room it evicts the least recently used snapshot not being restored from;
        raises `KVExhausted` when nothing more can be evicted."""
        restored, pending = self._bind(session, tokens, n_tokens, defer=False)
        assert pending is None
        return restored

    def bind_deferring(
        self, session: int, tokens: Sequence[int], n_tokens: int
    ) -> tuple[int, PendingRestore | None]:
        """`bind`, except that when the store restores the most, the file is not read
        here: ``session`` gets a fresh reservation (length 0) and the `PendingRestore` to
        `read` (without the engine lock) and `finish` (under it) comes back, with 0
        restored so far; otherwise ``(restored, None)`` as `bind`."""
        return self._bind(session, tokens, n_tokens, defer=True)

    def read(self, pending: PendingRestore, stop: Callable[[], bool] | None = None) -> bool:
        """Read ``pending``'s stored snapshot into its session's own cells
        (`KVPool.write_payload`), checking the file's SHA-256 as it goes; True when every
        part was read and checked, False when one failed or ``stop`` (asked before each
        part: a cancel) said so. Commits nothing: `finish` does. Safe without the engine
        lock (see the module's locking rule)."""
        assert self.store is not None
        upto = pending.match.usable

        def write(parts: Iterable[torch.Tensor]) -> None:
            self.pool.write_payload(pending.session, upto, parts)

        return self.store.restore(pending.match, write, stop)

    def finish(self, pending: PendingRestore, read: bool) -> int:
        """Under the engine lock, after `read` (``read``: its result): commit the stored
        positions, or, when the read failed, bind the session as `bind` would without the
        file (memory's match, else a fresh reservation); how many positions were restored."""
        upto, high_water = pending.match.usable, pending.match.entry.high_water
        if read:
            self.pool.commit_payload(pending.session, upto, high_water)
            restored = upto
        else:
            restored = self._rebind(pending)
        self._count(restored)
        return restored

    def _bind(
        self, session: int, tokens: Sequence[int], n_tokens: int, *, defer: bool
    ) -> tuple[int, PendingRestore | None]:
        match, rejected = self._match(tokens)
        if match is not None:
            match[0].pins += 1
        pending = None
        try:
            found = self._store_match(tokens, match)
            restored = None
            if found is not None and self._reserve_fresh(session, n_tokens):
                if defer:
                    pending = PendingRestore(session, tuple(tokens), n_tokens, found)
                    restored = 0
                else:
                    restored = self._load_from_store(session, found)
            if restored is None:
                restored = self._bind_evicting(session, n_tokens, match)
        finally:
            if match is not None:
                match[0].pins -= 1
        if pending is None:
            self._count(restored)
        if rejected:
            self.stats.rejections += 1
            self.stats.rejections_by_rule[RING_WRAPPED_RULE] += 1
        return restored, pending

    def _count(self, restored: int) -> None:
        if restored:
            self.stats.hits += 1
            self.stats.tokens_restored += restored
        else:
            self.stats.misses += 1

    def _match(self, tokens: Sequence[int]) -> tuple[tuple[Snapshot, int] | None, bool]:
        """The most recently used snapshot sharing the most leading ``tokens`` whose every
        layer still holds them (`KVPool.retains`), and how many it can restore (None:
        nothing usable); True when token-equal snapshots were there but every one was
        refused by the retention rule."""
        depth, keys = self._trie.longest(tokens)
        usable = min(depth, len(tokens) - 1)
        if usable <= 0:
            return None, False
        for key in [k for k in reversed(self._entries) if k in keys]:
            if self.pool.retains(key, usable):
                self._entries.move_to_end(key)
                self._offer(self._entries[key])  # hit: likely to be used again
                return (self._entries[key], usable), False
        return None, True

    def _store_match(
        self, tokens: Sequence[int], match: tuple[Snapshot, int] | None
    ) -> StoreMatch | None:
        """The stored snapshot that restores more of ``tokens`` than ``match`` (memory's)."""
        if self.store is None:
            return None
        return self.store.lookup(tokens, match[1] if match else 0)

    def _reserve_fresh(self, session: int, n_tokens: int) -> bool:
        """Reserve ``session`` afresh for a restore from the store (evicting as need be);
        False, nothing reserved, when the pool lacks room (memory's match may still bind,
        consuming its snapshot)."""
        try:
            self._bind_evicting(session, n_tokens, None)
        except KVExhausted:
            return False
        return True

    def _load_from_store(self, session: int, found: StoreMatch) -> int | None:
        """Read ``found`` into ``session`` (freshly reserved) and commit it; how many it
        restored, or None, ``session`` released, when the file fails its checks."""
        upto, high_water = found.usable, found.entry.high_water

        def load(parts: Iterable[torch.Tensor]) -> None:
            self.pool.load_payload(session, upto, high_water, parts)

        if self.store is not None and self.store.restore(found, load):
            return upto
        self.pool.release(session)
        return None

    def _rebind(self, pending: PendingRestore) -> int:
        """``pending``'s session bound without its failed file: released, then bound from
        memory's match as `bind` would (rejections were counted when it was bound), else
        afresh (the room it just gave back holds its reservation)."""
        session, n_tokens = pending.session, pending.n_tokens
        self.pool.release(session)
        match, _ = self._match(pending.tokens)
        if match is not None:
            match[0].pins += 1
        try:
            return self._bind_evicting(session, n_tokens, match)
        except KVExhausted:
            self.pool.reserve(session, n_tokens)
            return 0
        finally:
            if match is not None:
                match[0].pins -= 1

    def _bind_evicting(
        self, session: int, n_tokens: int, match: tuple[Snapshot, int] | None
    ) -> int:
        while True:
            try:
                if match is None:
                    self.pool.reserve(session, n_tokens)
                    return 0
                self.pool.reserve_from(session, n_tokens, match[0].key, match[1])
                return match[1]
            except KVExhausted:
                # Evicting frees blocks, and slots only where snapshots park them: with no
                # slot to free, yield nothing.
                if not self.pool.free_slots and not self.pool.parked_slots:
                    raise
                if self.evict_one():
                    continue
                if match is None:
                    raise
                return self._restore_consuming(session, n_tokens, match)

    def _restore_consuming(self, session: int, n_tokens: int, match: tuple[Snapshot, int]) -> int:
        """The last resort before refusing: restore from the matched snapshot while
        dropping it (`KVPool.reserve_from` with ``consume``), so the blocks it holds past
        the prefix, and the copy-on-write of its boundary block, are room for the request.
        A one-slot engine continuing its conversation lands here every turn."""
        entry, upto = match
        blocks = self.pool.snapshot_blocks(entry.key)
        self.pool.reserve_from(session, n_tokens, entry.key, upto, consume=True)
        self._forget(entry.key, blocks)
        self.stats.evictions += 1
        return upto

    # -- publication and eviction ----------------------------------------------------

    def publish(self, session: int, tokens: Sequence[int]) -> bool:
        """Snapshot the first ``len(tokens)`` positions of ``session`` (which hold
        ``tokens``' KV), then evict LRU snapshots down to the budget. False, changing
        nothing, when a snapshot already covers ``tokens`` (it is marked used), when one
        snapshot of this size would pass the budget, when the pool lacks room for the
        copy-on-write the session's next write would need, or when the pool parks slots
        (a running session's flat rows could only be copied out of the pool: its slot is
        parked when it finishes instead)."""
        if self.pool.parks_slots:
            return False
        frozen = tuple(tokens)
        depth, keys = self._trie.longest(frozen)
        if depth == len(frozen) and keys:
            self._entries.move_to_end(next(k for k in reversed(self._entries) if k in keys))
            return False
        if self._too_big(len(frozen)):
            return False
        key = next(self._keys)
        try:
            self.pool.publish(session, len(frozen), key)
        except KVExhausted:
            return False
        self._enter(key, frozen, offer=self.write_prompts)  # else offered once it is hit
        return True

    def release_into(self, session: int, tokens: Sequence[int]) -> bool:
        """Release ``session``, keeping its first ``len(tokens)`` positions (which hold
        ``tokens``' KV: a finished request's prompt and completion) as a snapshot, so the
        next turn of a conversation restores it (`KVPool.release_into`: its blocks or its
        parked slot change hands; only a cell pool's ring rows are copied). Evicts LRU
        snapshots down to the budget. False, and a plain release, when ``tokens`` is empty,
        a snapshot already covers it (that one is marked used and, as the conversation's
        latest turn, offered to the store) or one snapshot of this size would pass the
        budget."""
        frozen = tuple(tokens)
        depth, keys = self._trie.longest(frozen)
        covered = bool(keys) and depth == len(frozen)
        if not frozen or covered or self._too_big(len(frozen)):
            if covered:  # that one is the conversation's latest turn now
                key = next(k for k in reversed(self._entries) if k in keys)
                self._entries.move_to_end(key)
                self._offer(self._entries[key])
            self.pool.release(session)
            return False
        key = next(self._keys)
        self.pool.release_into(session, len(frozen), key)
        self._enter(key, frozen, offer=True)  # a conversation's latest turn
        return True

    def _enter(self, key: int, tokens: tuple[int, ...], *, offer: bool) -> None:
        """List the pool's new snapshot ``key``; drop the snapshots it covers (their tokens
        are a prefix of its own, so any match they give it gives too); with ``offer``,
        offer it to the store (and when a snapshot it covers was offered: it takes that
        one's place, on disk too); keep the budget."""
        covered = [
            k
            for k, e in self._entries.items()
            if e.pins == 0 and len(e.tokens) <= len(tokens) and tokens[: len(e.tokens)] == e.tokens
        ]
        for old in covered:
            if (ticket := self._tickets.pop(old, None)) is not None:
                ticket.cancel("superseded")  # the new one is offered in its place
            offer = offer or self._entries[old].offered
            self._drop(old)
        snapshot = self._entries[key] = Snapshot(key, tokens)
        self._trie.insert(key, tokens)
        self._block_holders.update(self.pool.snapshot_blocks(key))
        self.stats.published += 1
        if offer:
            self._offer(snapshot)
        while self.bytes_pinned > self.budget_bytes and self.evict_one():
            pass

    def _offer(self, snapshot: Snapshot) -> None:
        """Queue ``snapshot`` for the store, once (unless a file of its tokens is there)."""
        if self.store is None or snapshot.offered:
            return
        snapshot.offered = True
        if self.store.holds(snapshot.tokens):
            return
        payload, pool = self.pool.payload_of(snapshot.key), self.pool
        ticket = self.store.offer(
            snapshot.tokens, payload.high_water, lambda: pool.read_payload(payload)
        )
        if ticket is not None:
            self._tickets[snapshot.key] = ticket

    def evict_one(self) -> bool:
        """Drop the least recently used snapshot that no restore pins; False if none."""
        for key, entry in self._entries.items():
            if entry.pins == 0:
                self._drop(key)
                self.stats.evictions += 1
                return True
        return False

    def clear(self) -> None:
        """Drop every snapshot (the engine's close); none may be pinned."""
        assert self.pins == 0, "clearing a prefix cache under a live restore"
        if self.store is not None:
            self.store.flush(CLOSE_FLUSH_S)  # queued writes read the snapshots' blocks
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self._forget(key, self.pool.snapshot_blocks(key))
        self.pool.drop_snapshot(key)

    def _forget(self, key: int, blocks: list[int]) -> None:
        """Unlist ``key``, whose snapshot held ``blocks`` (trie, LRU, block counts)."""
        entry = self._entries.pop(key)
        ticket = self._tickets.pop(key, None)
        if ticket is not None:
            ticket.cancel()  # a write still copying it throws the copy away
        self._trie.remove(key, entry.tokens)
        self._block_holders.subtract(blocks)
        self._block_holders = +self._block_holders  # forget blocks no snapshot holds

    # -- checks ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The entries are exactly the pool's snapshots, with their lengths; the trie and
        the block counts match them; nothing is pinned outside a restore; the budget holds
        unless one snapshot is all that is left."""
        assert set(self._entries) == self.pool.snapshot_ids(), "entries ≠ pool snapshots"
        for key, entry in self._entries.items():
            assert entry.pins == 0, f"snapshot {key} pinned outside a restore"
            assert self.pool.snapshots[key].length == len(entry.tokens), f"length {key}"
        self._trie.check_integrity({k: e.tokens for k, e in self._entries.items()})
        held = Counter(b for k in self._entries for b in self.pool.snapshot_blocks(k))
        assert held == self._block_holders, "pinned block counts drifted"
        assert set(self._tickets) <= set(self._entries), "a write ticket outlived its snapshot"
        if self.store is not None:
            self.store.check_integrity(idle=False)
        assert self.bytes_pinned <= self.budget_bytes or len(self._entries) <= 1, "over budget"
