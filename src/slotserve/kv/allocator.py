"""`BlockAllocator`: fixed-size KV blocks from one free list, with reference counts.

A block is free (refcount 0, on the free list) or held by one or more block tables
(refcount = number of tables holding it). It knows nothing of tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from slotserve.errors import KVExhausted


class BlockAllocator:
    def __init__(self, total: int) -> None:
        self.total = total
        self.free: list[int] = list(range(total - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.refcount = [0] * total

    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def n_used(self) -> int:
        return self.total - len(self.free)

    def allocate(self, n: int, hint: str = "") -> list[int]:
        """``n`` fresh blocks (refcount 1), or `KVExhausted` and nothing changes."""
        if n > len(self.free):
            raise KVExhausted("KV blocks", n, len(self.free), hint)
        blocks = [self.free.pop() for _ in range(n)]
        for block in blocks:
            self.refcount[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            assert self.refcount[block] > 0, f"sharing free block {block}"
            self.refcount[block] += 1

    def drop(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            assert self.refcount[block] > 0, f"dropping free block {block}"
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free.append(block)

    def check_integrity(self, tables: Iterable[list[int]]) -> None:
        """Free + used = total; each refcount equals the number of tables holding it."""
        held = Counter(block for table in tables for block in table)
        free = set(self.free)
        assert len(free) == len(self.free), "a block is on the free list twice"
        for block in range(self.total):
            assert self.refcount[block] == held[block], (
                f"block {block}: refcount {self.refcount[block]} but {held[block]} tables hold it"
            )
            assert (block in free) == (held[block] == 0), f"block {block} free/used mismatch"
