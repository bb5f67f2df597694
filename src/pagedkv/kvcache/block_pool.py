"""The physical block pool: ref counts, a free queue with lazy eviction, and the hash index.

Block 0 is the null block: never handed out, it pads block tables. Every other block is in
exactly one state:

* in use: ``ref_count > 0`` (one count per sequence whose block table holds it);
* cached: ``ref_count == 0``, still holds a hash, sits in the free queue and can be revived by a
  prefix hit until it is handed out again (lazy eviction);
* free: ``ref_count == 0``, no hash, in the free queue.

The free queue is an intrusive circular doubly linked list kept in two integer arrays
(``_next``, ``_prev``) indexed by block id, with the null block's slot as the sentinel (it is
never queued), so popping the head, appending at the tail and unlinking a block
revived from the middle are all O(1). Blocks leave from the head: the least recently freed go
first. Callers free a sequence's blocks tail first, so within one sequence the tail (least
likely to be shared) is evicted before the head.

State is kept as parallel lists rather than one object per block: the hot loops (free a
2,000-token sequence, admit a prompt) then touch plain ints, several times faster in CPython.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.kvcache.hashing import BlockHash

NULL_BLOCK_ID = 0
_SENTINEL = NULL_BLOCK_ID  # links of the null block's slot: head = _next[0], tail = _prev[0]


@dataclass(frozen=True)
class BlockInfo:
    """A read-only snapshot of one block (for inspection and tests; not used on hot paths)."""

    block_id: int
    ref_count: int
    block_hash: BlockHash | None


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots; block 0 is reserved as the null block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Hash -> block id of the block that holds that prefix (in use or cached).
        self.cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # Free queue over blocks 1..n-1 in id order; the null block is never linked.
        # Circular: 0 -> 1 -> ... -> n-1 -> 0, so no operation needs an end-of-list branch.
        self._next = [(i + 1) % num_blocks for i in range(num_blocks)]
        self._prev = [(i - 1) % num_blocks for i in range(num_blocks)]
        self.ref_counts[NULL_BLOCK_ID] = 1  # pinned forever, never counted as free
        self.num_free = num_blocks - 1
        self.num_cached_free = 0  # blocks in the free queue that still hold a hash

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash`` (in use or cached), or None."""
        return self.cached.get(block_hash)

    def block(self, block_id: int) -> BlockInfo:
        return BlockInfo(block_id, self.ref_counts[block_id], self.block_hashes[block_id])

    def free_queue(self) -> list[int]:
        """The free queue, head (next to be handed out) first. O(n): for tests and debugging."""
        out, b = [], self._next[_SENTINEL]
        while b != _SENTINEL:
            out.append(b)
            b = self._next[b]
        return out

    # -- mutation --------------------------------------------------------------------------

    def take(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue with ref_count 1. Cached
        ones lose their hash (evicted). The caller must have checked ``num_free``."""
        if num_blocks > self.num_free:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free} free")
        nxt, refs, hashes = self._next, self.ref_counts, self.block_hashes
        out = []
        b = nxt[_SENTINEL]
        for _ in range(num_blocks):
            out.append(b)
            refs[b] = 1
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                del self.cached[h]
                self.num_cached_free -= 1
                self.num_evictions += 1
            b = nxt[b]
        nxt[_SENTINEL] = b
        self._prev[b] = _SENTINEL
        self.num_free -= num_blocks
        return out

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; a cached block is revived out of the free queue."""
        refs, nxt, prv = self.ref_counts, self._next, self._prev
        for b in block_ids:
            if refs[b] == 0:
                p, n = prv[b], nxt[b]
                nxt[p] = n
                prv[n] = p
                self.num_free -= 1
                if self.block_hashes[b] is not None:
                    self.num_cached_free -= 1
            refs[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order; a block whose count reaches
        zero is appended to the free queue (keeping its hash). Pass a sequence's blocks tail
        first so that its tail is evicted before its head."""
        refs, nxt, prv, hashes = self.ref_counts, self._next, self._prev, self.block_hashes
        tail = prv[_SENTINEL]
        freed = cached = 0
        for b in block_ids:
            r = refs[b] - 1
            refs[b] = r
            if r == 0:
                nxt[tail] = b
                prv[b] = tail
                tail = b
                freed += 1
                if hashes[b] is not None:
                    cached += 1
            elif r < 0:
                refs[b] = 0
                nxt[tail] = _SENTINEL
                prv[_SENTINEL] = tail
                raise ValueError(f"block {b} released more often than it was referenced")
        nxt[tail] = _SENTINEL
        prv[_SENTINEL] = tail
        self.num_free += freed
        self.num_cached_free += cached

    def set_hash(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, in-use block under ``block_hash``. If another block already holds
        that prefix, the first one stays the shared copy and this one is left unhashed (it is
        freed, not cached, when released); returns whether the block was registered."""
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        return True

    def evict_all_cached(self) -> int:
        """Drop every cached hash of the free queue (a cache reset); returns how many."""
        n = 0
        for b in self.free_queue():
            h = self.block_hashes[b]
            if h is not None:
                self.block_hashes[b] = None
                del self.cached[h]
                n += 1
        self.num_cached_free = 0
        self.num_evictions += n
        return n

    def check_invariants(self) -> None:
        queue = self.free_queue()
        in_queue = set(queue)
        assert len(in_queue) == len(queue) == self.num_free, "free queue length or cycle"
        assert NULL_BLOCK_ID not in in_queue, "null block in the free queue"
        assert self.ref_counts[NULL_BLOCK_ID] >= 1, "null block unpinned"
        for b in range(1, self.num_blocks):
            r = self.ref_counts[b]
            assert r >= 0, f"block {b} ref_count {r}"
            assert (r == 0) == (b in in_queue), f"block {b}: ref {r} vs free-queue membership"
        n_cached = sum(1 for b in queue if self.block_hashes[b] is not None)
        assert n_cached == self.num_cached_free, "cached-free counter drifted"
        for h, b in self.cached.items():
            assert self.block_hashes[b] == h, f"hash index points at block {b} with another hash"
        n_hashed = sum(1 for h in self.block_hashes if h is not None)
        assert n_hashed == len(self.cached), "a hashed block is missing from the hash index"
        prev = _SENTINEL
        for b in queue:
            assert self._prev[b] == prev, f"broken back link at block {b}"
            prev = b
        assert self._prev[_SENTINEL] == prev, "tail pointer"
