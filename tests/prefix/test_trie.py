"""TokenTrie: longest-match equals a brute-force longest common prefix, under random
inserts and removes, and the trie's own invariants hold throughout."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.prefix import TokenTrie

SEQS = st.lists(st.integers(0, 3), min_size=1, max_size=8)


def common(a: list[int] | tuple[int, ...], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), SEQS), max_size=20), SEQS)
def test_longest_is_the_longest_common_prefix(
    ops: list[tuple[bool, list[int]]], probe: list[int]
) -> None:
    trie, next_key = TokenTrie(), 0
    entries: dict[int, tuple[int, ...]] = {}
    for insert, tokens in ops:
        if insert or not entries:
            trie.insert(next_key, tokens)
            entries[next_key] = tuple(tokens)
            next_key += 1
        else:
            key = min(entries)
            trie.remove(key, entries.pop(key))
        trie.check_integrity(entries)
    depth, keys = trie.longest(probe)
    best = max((common(t, probe) for t in entries.values()), default=0)
    assert depth == best
    assert keys == ({k for k, t in entries.items() if common(t, probe) >= best} if best else set())


def test_a_long_sequence_checks_without_recursion() -> None:
    trie = TokenTrie()
    trie.insert(1, list(range(5000)))
    trie.check_integrity({1: tuple(range(5000))})
    trie.remove(1, list(range(5000)))
    trie.check_integrity({})
