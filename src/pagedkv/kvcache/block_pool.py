"""The physical block pool: ref counts, the free blocks in eviction order, and the hash index.

Block 0 is the null block: never handed out, it pads block tables. Every other block is in
exactly one state:

* in use: ``ref_count > 0`` (one count per sequence whose block table holds it);
* cached: ``ref_count == 0``, still holds a hash, and can be revived by a prefix hit until it is
  handed out again (lazy eviction);
* empty: ``ref_count == 0``, no hash: it holds nothing anyone can reuse.

Free blocks leave in vLLM's free-queue order (``docs/prefix_cache.md``): empty ones first,
then cached ones least recently freed first, so a cached prefix is evicted only when no empty
block is left. A release puts its new empty blocks in front, first given first (a table freed
tail first hands out its tail block first); a cache reset moves nothing (the dropped blocks
stay behind the blocks that were empty already). The empty blocks are a list used as a stack
(its end is the front), the cached ones a ``CachedQueue`` (``cached_queue.py``): freeing a
sequence is one C-level bulk move per kind of block.

Two blocks may hold the same prefix (computed before either was cached, or an identical
prompt recomputing its last block). Every copy in use is indexed, so the prefix lives as long
as any copy; a copy freed while another is in use, or a cached one superseded by a new copy,
becomes empty. A hash is held by one or more blocks in use or by exactly one cached block:
the cache never spends two blocks on one prefix (vLLM does; the doc says why not here).

State is kept as parallel lists rather than one object per block: the hot loops (free a
2,000-token sequence, admit a prompt) then touch plain ints, several times faster in CPython.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedkv.kvcache.cached_queue import CachedQueue
from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.units import check_block_size

NULL_BLOCK_ID = 0


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots; block 0 is reserved as the null block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_block_size(block_size)
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts: list[int] = [0] * num_blocks
        self.ref_counts[NULL_BLOCK_ID] = 1  # pinned forever, never free
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Hash -> one block holding that prefix (in use or cached); lookups return it.
        self.index: dict[BlockHash, int] = {}
        # Hash -> the other blocks in use that hold the same prefix (rare: see the docstring).
        self._copies: dict[BlockHash, list[int]] = {}
        # Empty free blocks, a stack: the top (end) is handed out next. Starts so that a fresh
        # pool hands out blocks 1, 2, 3, ...
        self._empty: list[int] = list(range(num_blocks - 1, 0, -1))
        # Cached free blocks, least recently freed first.
        self._cached = CachedQueue(num_blocks)
        self.num_evictions = 0
        # Called with (block_id, hash) for every cached block ``take`` evicts (the lower tiers
        # of ``tiers/contract.py`` take it over), before the block is handed out. None = no one listens.
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # Told of every hash that leaves the index (``events.py``); the allocator reports the
        # ones that enter it, as it alone knows their parents. None = no one listens.
        self.events: KVEventLog | None = None
        # Called with every hash leaving the index (``partial.py`` forgets it). None = no one.
        self.on_unindex: Callable[[BlockHash], None] | None = None

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_allocatable(self) -> int:
        """Blocks ``take`` may hand out now: empty ones plus cached ones it would evict."""
        return len(self._empty) + len(self._cached)

    @property
    def num_empty(self) -> int:
        """Free blocks that hold nothing reusable."""
        return len(self._empty)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a hash (revivable by a prefix hit)."""
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """A block holding ``block_hash`` (in use or cached), or None."""
        return self.index.get(block_hash)

    def free_queue(self) -> list[int]:
        """Every free block, the next to be handed out first. O(n): for tests and debugging."""
        return self._empty[::-1] + self._cached.in_order()

    # -- mutation --------------------------------------------------------------------------

    def take(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` blocks with ref_count 1: empty ones first, then the least
        recently freed cached ones, which lose their hash (evicted). The caller must have
        checked ``num_allocatable``."""
        empty = self._empty
        k = min(num_blocks, len(empty))
        if num_blocks > self.num_allocatable:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_allocatable} free")
        out = empty[: -k - 1 : -1] if k else []
        del empty[len(empty) - k :]
        if k < num_blocks:
            pop, hashes, index = self._cached.pop_oldest, self.block_hashes, self.index
            on_evict, events, on_unindex = self.on_evict, self.events, self.on_unindex
            for _ in range(num_blocks - k):
                b = pop()
                h = hashes[b]
                assert h is not None  # a cached block holds its hash
                if on_evict is not None:
                    on_evict(b, h)
                if events is not None:
                    events.removed(h)
                if on_unindex is not None:
                    on_unindex(h)
                del index[h]  # the only holder of its hash (see the docstring)
                hashes[b] = None
                out.append(b)
            self.num_evictions += num_blocks - k
        refs = self.ref_counts
        for b in out:
            refs[b] = 1
        return out

    def claim(self, block_id: int) -> None:
        """Hand out the cached block ``block_id`` itself with ref_count 1, its hash leaving
        as in an eviction (offered to the lower tiers, reported, unindexed): a partial prefix
        hit claims an unreferenced leaf in place (TRT-LLM's rule), keeping its first slots and
        overwriting the rest. Not counted as an eviction: its KV is reused."""
        h = self.block_hashes[block_id]
        if self.ref_counts[block_id] or h is None:
            raise ValueError(f"block {block_id} is not a cached block")
        self._cached.remove(block_id)
        self.ref_counts[block_id] = 1
        self.block_hashes[block_id] = None
        if self.on_evict is not None:
            self.on_evict(block_id, h)
        if self.events is not None:
            self.events.removed(h)
        if self.on_unindex is not None:
            self.on_unindex(h)
        del self.index[h]

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; a free one (a cached block hit by a prefix match)
        is revived out of the free blocks."""
        refs = self.ref_counts
        for b in block_ids:
            if refs[b] == 0:
                if self.block_hashes[b] is not None:
                    self._cached.remove(b)
                else:
                    self._empty.remove(b)  # never on the hot path: hits are hashed
            refs[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order. A block whose count reaches
        zero becomes empty if it has no hash (or another copy of its hash is still in use),
        else it joins the cached blocks as the most recently freed. The new empty blocks go in
        front of the other free ones, first given first. Pass a sequence's blocks tail first
        so that its tail is evicted (or handed out) before its head."""
        refs, hashes, push_cached = self.ref_counts, self.block_hashes, self._cached.entries.append
        emptied: list[int] = []
        push_empty = emptied.append
        copies = self._copies
        for b in block_ids:
            r = refs[b] - 1
            refs[b] = r
            if r:
                if r < 0:
                    refs[b] = 0
                    self._empty += reversed(emptied)  # the pool stays whole for the caller
                    raise ValueError(f"block {b} released more often than it was referenced")
                continue
            h = hashes[b]
            if h is None:
                push_empty(b)
            elif copies and h in copies:
                self._drop_copy(b, h)
                push_empty(b)
            else:
                push_cached(b)
        if emptied:  # the stack's end is the front: the first given goes on top
            self._empty += reversed(emptied)
        self._cached.compact_if_needed()

    def release_table(self, block_ids: list[int], num_hashed: int) -> None:
        """``release(reversed(block_ids))`` for a sequence's block table whose first
        ``num_hashed`` blocks hold a hash and whose others hold none. When the sequence is the
        only holder of every block and no hash has copies (the common case), the blocks go to
        the cached and empty blocks in two C-level bulk moves."""
        refs = self.ref_counts
        if self._copies or sum(map(refs.__getitem__, block_ids)) != len(block_ids):
            self.release(reversed(block_ids))
            return
        for b in block_ids:
            refs[b] = 0
        # Empty: the unhashed tail, its last block on top of the stack (handed out first).
        if num_hashed:
            self._empty += block_ids[num_hashed:]
            self._cached.entries += block_ids[num_hashed - 1 :: -1]  # evicted last block first
            self._cached.compact_if_needed()
        else:
            self._empty += block_ids

    def _drop_copy(self, block_id: int, block_hash: BlockHash) -> None:
        """Unhash ``block_id``, one of several in-use copies of ``block_hash``."""
        others = self._copies[block_hash]
        if self.index[block_hash] == block_id:
            self.index[block_hash] = others.pop()
        else:
            others.remove(block_id)
        if not others:
            del self._copies[block_hash]
        self.block_hashes[block_id] = None

    def set_hash(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, in-use block under ``block_hash``. If a cached (unreferenced) block
        already holds that prefix, this block supersedes it and the cached one becomes empty;
        if blocks in use hold it, this one is indexed beside them. Returns whether the hash is
        new to the index (a KV event's "stored")."""
        held = self.index.get(block_hash)
        if held == block_id:
            return False
        self.block_hashes[block_id] = block_hash
        if held is None:
            self.index[block_hash] = block_id
            return True
        if self.ref_counts[held] == 0:
            self._cached.remove(held)
            self.block_hashes[held] = None
            self._empty.append(held)
            self.index[block_hash] = block_id
        else:
            self._copies.setdefault(block_hash, []).append(block_id)
        return False

    def evict_all_cached(self) -> int:
        """Drop every cached hash (a cache reset); returns how many blocks were dropped. The
        free order does not change (as vLLM's reset): the dropped blocks, now empty, come
        after the blocks that were empty already, least recently freed first."""
        hashes, index = self.block_hashes, self.index
        cached = self._cached.in_order()
        events = self.events
        for b in cached:
            h = hashes[b]
            assert h is not None  # a cached block holds its hash
            if events is not None:
                events.removed(h)
            if self.on_unindex is not None:
                self.on_unindex(h)
            del index[h]
            hashes[b] = None
        self._empty[:0] = cached[::-1]  # the stack's bottom is the back of the free order
        self._cached.clear()
        self.num_evictions += len(cached)
        return len(cached)

    def check_invariants(self) -> None:
        empty, hashes, refs = self._empty, self.block_hashes, self.ref_counts
        in_empty = set(empty)
        assert len(in_empty) == len(empty), "a block is twice among the empty blocks"
        cached = self._cached.check_invariants()
        assert not in_empty & cached, "a block is both empty and cached"
        assert NULL_BLOCK_ID not in in_empty and NULL_BLOCK_ID not in cached, "null block free"
        assert refs[NULL_BLOCK_ID] >= 1, "null block unpinned"
        for b in range(1, self.num_blocks):
            r = refs[b]
            assert r >= 0, f"block {b} ref_count {r}"
            assert (r == 0) == (b in in_empty or b in cached), f"block {b}: ref {r} vs free"
            if b in in_empty:
                assert hashes[b] is None, f"empty block {b} holds a hash"
            if b in cached:
                assert hashes[b] is not None, f"cached block {b} holds no hash"
        for h, b in self.index.items():
            assert hashes[b] == h, f"hash index points at block {b} with another hash"
            others = self._copies.get(h, [])
            if refs[b] == 0:
                assert not others, f"block {b} is cached while copies of its hash are in use"
            for c in others:
                assert c != b and hashes[c] == h and refs[c] > 0, f"stale copy {c} of block {b}"
        assert self._copies.keys() <= self.index.keys(), "copies of a hash nobody indexes"
        n_copies = sum(len(v) for v in self._copies.values())
        n_hashed = sum(1 for h in hashes if h is not None)
        assert n_hashed == len(self.index) + n_copies, "a hashed block is missing from the index"
