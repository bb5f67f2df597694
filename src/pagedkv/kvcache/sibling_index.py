"""``SiblingIndex``: the partial-reuse index (``partial.py``), a per-block token trie flattened.

For each parent hash (a block's chained hash, or a tenant's root) it keeps the token ids of the
indexed blocks that follow it, serialised (``hashing.token_bytes``), in sorted order. The string
sharing the longest prefix with a query is one of the query's two neighbours in that order, so a
lookup is one ``bisect`` and two binary-searched comparisons: O(log children + log B).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from pagedkv.kvcache.hashing import BlockHash

_TOKEN_BYTES = 4  # ``hashing.token_bytes``: little-endian uint32


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two serialised token strings share (binary search on slice equality:
    O(log n) C-level comparisons)."""
    n = min(len(a), len(b)) // _TOKEN_BYTES
    if a[: n * _TOKEN_BYTES] == b[: n * _TOKEN_BYTES]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi], in tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * _TOKEN_BYTES] == b[: mid * _TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


class SiblingIndex:
    """Parent hash -> ``(token bytes, child hash)`` of its indexed children, sorted."""

    def __init__(self) -> None:
        self._children: dict[BlockHash, list[tuple[bytes, BlockHash]]] = {}
        self._parent_of: dict[BlockHash, tuple[BlockHash, bytes]] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def __contains__(self, child: BlockHash) -> bool:
        return child in self._parent_of

    def add(self, parent: BlockHash, child: BlockHash, tokens: bytes) -> None:
        """Index ``child`` (a full block's hash) under ``parent``; idempotent."""
        if child in self._parent_of:
            return
        self._parent_of[child] = (parent, tokens)
        insort(self._children.setdefault(parent, []), (tokens, child))

    def remove(self, child: BlockHash) -> None:
        """Forget ``child`` (no-op for a hash never added)."""
        entry = self._parent_of.pop(child, None)
        if entry is None:
            return
        parent, tokens = entry
        siblings = self._children[parent]
        del siblings[bisect_left(siblings, (tokens, child))]
        if not siblings:
            del self._children[parent]

    def has_children(self, parent: BlockHash) -> bool:
        return parent in self._children

    def candidates(self, parent: BlockHash, query: bytes) -> list[tuple[int, BlockHash]]:
        """``(shared tokens, child)`` of the (at most two) children next to ``query`` in sorted
        order, most shared first; one of them shares the most tokens of any child."""
        siblings = self._children.get(parent)
        if not siblings:
            return []
        i = bisect_left(siblings, (query,))
        out = [
            (common_prefix_tokens(siblings[j][0], query), siblings[j][1])
            for j in (i - 1, i)
            if 0 <= j < len(siblings)
        ]
        return sorted((c for c in out if c[0] > 0), reverse=True)

    def check_invariants(self, indexed: set[BlockHash] | dict[BlockHash, int]) -> None:
        count = 0
        for parent, siblings in self._children.items():
            assert siblings == sorted(siblings), f"children of {parent.hex()[:8]} unsorted"
            for tokens, child in siblings:
                assert self._parent_of[child] == (parent, tokens), "sibling entry drifted"
                assert child in indexed, "a partial-match entry outlives its block's hash"
            count += len(siblings)
        assert count == len(self._parent_of), "sibling entries counted twice"
