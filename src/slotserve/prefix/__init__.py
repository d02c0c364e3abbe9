"""Prefix reuse: `PrefixCache` keeps immutable KV snapshots of completed prefills (cell
layout, blocks shared by refcount) and restores the longest usable one into new requests."""

from slotserve.prefix.cache import PrefixCache, PrefixStats, Snapshot
from slotserve.prefix.trie import TokenTrie

__all__ = ["PrefixCache", "PrefixStats", "Snapshot", "TokenTrie"]
