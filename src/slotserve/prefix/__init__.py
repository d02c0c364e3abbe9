"""Prefix reuse: `PrefixCache` keeps immutable KV snapshots of completed prefills and
finished conversations (cell layout, blocks shared by refcount, sliding-window rings copied)
and restores the longest one every layer still holds into new requests."""

from slotserve.prefix.cache import PrefixCache, PrefixCounters, Snapshot
from slotserve.prefix.trie import TokenTrie

__all__ = ["PrefixCache", "PrefixCounters", "Snapshot", "TokenTrie"]
