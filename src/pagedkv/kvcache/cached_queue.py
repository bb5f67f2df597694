"""``CachedQueue``: the cached free blocks of a pool, least recently freed first.

A ``deque`` of block ids in the order they were freed, with lazy deletion: a cached block that
leaves other than by being evicted (revived by a prefix hit, or superseded by a new copy of its
prefix) keeps its entry and gets one stale mark. A block's oldest entries are always its stale
ones (it can only be freed again, adding a newer entry, after it left), so the oldest live
entry is found by popping from the left and skipping an entry while its block has marks.

Why not a linked list or an ``OrderedDict``: freeing a sequence then costs one C-level
``extend`` of ``entries`` for all its hashed blocks (``BlockPool.release_table``), instead of a
splice or a node allocation per block. Stale entries are compacted away once the deque holds
twice as many entries as the pool has blocks, so it stays O(blocks) and every operation is
amortized O(1).
"""

from __future__ import annotations

from collections import deque


class CachedQueue:
    """Cached free blocks of a pool of ``num_blocks`` blocks. Hot paths may append to or
    extend ``entries`` directly (each appended block must not be live in the queue already)
    and then call ``compact_if_needed``."""

    __slots__ = ("entries", "_stale", "_num_stale", "_limit")

    def __init__(self, num_blocks: int) -> None:
        self.entries: deque[int] = deque()
        self._stale = [0] * num_blocks  # per block: how many of its entries are stale
        self._num_stale = 0
        self._limit = 2 * num_blocks

    def __len__(self) -> int:
        """Cached blocks (live entries)."""
        return len(self.entries) - self._num_stale

    def remove(self, block_id: int) -> None:
        """``block_id`` (live in the queue) leaves the cache without being evicted."""
        self._stale[block_id] += 1
        self._num_stale += 1

    def pop_oldest(self) -> int:
        """Remove and return the least recently freed cached block (the queue is not empty)."""
        pop, stale = self.entries.popleft, self._stale
        while True:
            b = pop()
            if not stale[b]:
                return b
            stale[b] -= 1
            self._num_stale -= 1

    def in_order(self) -> list[int]:
        """The cached blocks, least recently freed first. O(entries)."""
        marks, out = list(self._stale), []
        for b in self.entries:
            if marks[b]:
                marks[b] -= 1
            else:
                out.append(b)
        return out

    def compact_if_needed(self) -> None:
        if len(self.entries) > self._limit:
            self.entries = deque(self.in_order())
            self._stale = [0] * len(self._stale)
            self._num_stale = 0

    def clear(self) -> None:
        self.entries.clear()
        self._stale = [0] * len(self._stale)
        self._num_stale = 0

    def check_invariants(self) -> set[int]:
        """Assert the bookkeeping holds; return the set of cached blocks."""
        order = self.in_order()
        cached = set(order)
        assert len(cached) == len(order) == len(self), "a block is cached twice"
        assert sum(self._stale) == self._num_stale, "stale-mark counter drifted"
        live = [-m for m in self._stale]  # per block: entries minus marks = 1 iff cached
        for b in self.entries:
            live[b] += 1
        for b, n in enumerate(live):
            assert n == (b in cached), f"block {b}: {n} live entries in the cached queue"
        assert len(self.entries) <= self._limit + len(self._stale), "stale entries pile up"
        return cached
