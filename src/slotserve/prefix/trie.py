"""`TokenTrie`: the token sequences of the prefix cache's snapshots, for longest-match.

One node per token; each node knows which snapshots pass through it, so the deepest node a
prompt reaches names the snapshots that share that many leading tokens with it. It stores
keys only; what a key means (a pool snapshot) is the cache's business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class _Node:
    __slots__ = ("children", "holders")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.holders: set[int] = set()


class TokenTrie:
    """Keys inserted with their token sequences; a key passes through every node on its
    path (the root included) and ends at the node of its last token."""

    def __init__(self) -> None:
        self._root = _Node()

    def insert(self, key: int, tokens: Sequence[int]) -> None:
        node = self._root
        node.holders.add(key)
        for token in tokens:
            node = node.children.setdefault(token, _Node())
            node.holders.add(key)

    def remove(self, key: int, tokens: Sequence[int]) -> None:
        """Remove ``key`` from its path, pruning nodes no key passes through any more."""
        node = self._root
        node.holders.discard(key)
        for token in tokens:
            child = node.children[token]
            child.holders.discard(key)
            if not child.holders:
                del node.children[token]  # the whole subtree held only this key
                return
            node = child

    def longest(self, tokens: Sequence[int]) -> tuple[int, set[int]]:
        """How many leading ``tokens`` some key shares, and the keys that share them
        (depth 0: no token shared, no key)."""
        node, depth = self._root, 0
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
        return depth, (set(node.holders) if depth else set())

    def reach(self, tokens: Sequence[int]) -> list[tuple[int, set[int]]]:
        """For each depth ``d`` along ``tokens``' path, deepest first, the keys that share
        exactly ``d`` leading tokens with it (their paths end or leave it there)."""
        path: list[set[int]] = []
        node = self._root
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            path.append(child.holders)
            node = child
        found: list[tuple[int, set[int]]] = []
        deeper: set[int] = set()
        for depth in range(len(path), 0, -1):
            here = path[depth - 1] - deeper
            if here:
                found.append((depth, here))
            deeper = path[depth - 1]
        return found

    def check_integrity(self, entries: Mapping[int, Sequence[int]]) -> None:
        """Every node's holders are exactly the keys whose sequence passes through it."""
        assert self._root.holders == set(entries), "root holders ≠ entries"
        for key, tokens in entries.items():
            node = self._root
            for token in tokens:
                assert token in node.children, f"key {key}: path broken"
                node = node.children[token]
                assert key in node.holders, f"key {key} missing from its path"
        stack = [(self._root, 0)]  # iterative: a path is as deep as a long prompt
        while stack:
            node, depth = stack.pop()
            for child in node.children.values():
                assert child.holders, "an empty node was not pruned"
                assert child.holders <= node.holders, "a child holds a key its parent does not"
                assert all(len(entries[k]) > depth for k in child.holders), "held past its end"
                stack.append((child, depth + 1))
