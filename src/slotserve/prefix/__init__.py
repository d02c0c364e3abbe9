"""Prefix reuse: `PrefixCache` keeps immutable KV snapshots of completed prefills and
finished conversations (cell layout, blocks shared by refcount, sliding-window rings copied)
and restores the longest one every layer still holds into new requests; `PrefixStore` is
its disk tier (one checked file a snapshot, under a byte budget), so they survive a
restart."""

from slotserve.prefix.cache import PendingRestore, PrefixCache, PrefixCounters, Snapshot
from slotserve.prefix.fingerprint import ModelFingerprint, fingerprint
from slotserve.prefix.store import (
    REFUSAL_REASONS,
    SKIP_REASONS,
    PrefixStore,
    PrefixStoreError,
    StoreIdentity,
    StoreReport,
    open_store,
)
from slotserve.prefix.trie import TokenTrie

__all__ = [
    "REFUSAL_REASONS",
    "SKIP_REASONS",
    "ModelFingerprint",
    "PendingRestore",
    "PrefixCache",
    "PrefixCounters",
    "PrefixStore",
    "PrefixStoreError",
    "Snapshot",
    "StoreIdentity",
    "StoreReport",
    "TokenTrie",
    "fingerprint",
    "open_store",
]
