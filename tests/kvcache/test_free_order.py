"""Which free block is handed out next, and what happens to a block computed twice.

Hand-built operation streams with block size 4 and every expected block id or token count
worked out by hand from the rule: empty blocks (no hash) go first, most recently freed first;
cached blocks after them, least recently freed first; a prefix stays cached as long as any
block holding it is alive, and is never cached in two blocks at once.
"""

from __future__ import annotations

from pagedkv.kvcache import NO_EXTRA_KEYS, BlockPool, PagedAllocator, hash_blocks, root_hash

from .conftest import Seq, admit


def test_pool_hands_out_empty_blocks_before_cached_ones():
    pool = BlockPool(num_blocks=7, block_size=1)
    a = pool.take(3)  # blocks 1, 2, 3
    assert a == [1, 2, 3]
    pool.set_hash(1, b"\x01" * 32)
    pool.set_hash(2, b"\x02" * 32)  # block 3 stays partial: no hash
    pool.release(reversed(a))  # tail first: 3 (empty), 2, 1 (cached)
    pool.check_invariants()
    # Empty: 3 on top of the never-used 4, 5, 6; cached after them, 2 before 1.
    assert pool.free_queue() == [3, 4, 5, 6, 2, 1]
    assert (pool.num_empty, pool.num_cached, pool.num_allocatable) == (4, 2, 6)
    assert pool.take(4) == [3, 4, 5, 6] and pool.num_evictions == 0
    assert pool.lookup(b"\x01" * 32) == 1 and pool.lookup(b"\x02" * 32) == 2
    assert pool.take(1) == [2] and pool.num_evictions == 1
    pool.check_invariants()


def test_a_cached_prefix_outlives_blocks_that_hold_nothing_reusable():
    # Fails with a single FIFO free queue: block 3 (tokens 4..7 of `a`) was evicted there while
    # block 1, which holds nothing reusable, waited behind it.
    alloc = PagedAllocator(num_blocks=9, block_size=4)  # 8 usable blocks
    x = Seq(1, [100, 101, 102])  # block 1, partial
    a = Seq(2, list(range(9)))  # blocks 2, 3 full (cached when freed), 4 partial
    admit(alloc, x)
    admit(alloc, a)
    alloc.free(a)
    alloc.free(x)
    assert alloc.stats().num_cached_blocks == 2
    filler = Seq(3, list(range(1000, 1024)))  # 6 blocks: exactly the 6 empty ones
    assert admit(alloc, filler) == 0
    alloc.check_invariants()
    assert alloc.stats().num_evictions == 0
    assert alloc.match_prefix(Seq(4, list(range(9)) + [50])) == 8
    # The next block must come from the cache: the least recently freed, `a`'s tail block.
    more = Seq(5, list(range(2000, 2004)))
    assert admit(alloc, more) == 0
    assert alloc.stats().num_evictions == 1
    assert alloc.match_prefix(Seq(6, list(range(9)) + [50])) == 4


def test_allocatable_and_empty_block_counts_differ_by_the_cached_blocks():
    alloc = PagedAllocator(num_blocks=9, block_size=4)  # 8 usable blocks
    a = Seq(1, list(range(17)))  # 4 full blocks + 1 partial
    admit(alloc, a)
    alloc.free(a)
    st = alloc.stats()
    assert alloc.num_allocatable_blocks == 8  # a new sequence may take all of them
    assert (st.num_empty_blocks, st.num_cached_blocks, st.num_used_blocks) == (4, 4, 0)


def _compute_twice(alloc: PagedAllocator) -> tuple[Seq, Seq]:
    """`a` and `b` both compute the full block [0, 1, 2, 3]: `a` started its prefill before
    `b` registered that block, so `a` could not hit it."""
    a = Seq(1, [0, 1, 2, 3, 10, 11])
    b = Seq(2, [0, 1, 2, 3, 20])
    assert alloc.allocate(a, 2)  # a's first chunk: tokens 0, 1 (block 1)
    assert admit(alloc, b) == 0  # blocks 2 (full, registered), 3
    assert alloc.allocate(a, 4)  # a's block 1 fills now: the same prefix as b's block 2
    alloc.check_invariants()
    assert alloc.block_table(a)[0] == 1 and alloc.block_table(b)[0] == 2
    return a, b


def test_a_prefix_computed_twice_survives_while_either_copy_lives():
    # Fails when only the first copy is indexed: once b freed its copy and the filler evicted
    # it, the prefix was lost although a still held the same KV in block 1.
    alloc = PagedAllocator(num_blocks=7, block_size=4)  # 6 usable blocks
    a, b = _compute_twice(alloc)
    alloc.free(b)  # b's copy is redundant (a holds the prefix in use): it becomes empty
    assert alloc.stats().num_cached_blocks == 0
    filler = Seq(3, list(range(500, 500 + 4 * alloc.num_allocatable_blocks)))
    assert admit(alloc, filler) == 0  # takes every free block
    assert alloc.match_prefix(Seq(4, [0, 1, 2, 3, 9])) == 4  # served by a's block 1
    alloc.free(a)
    alloc.check_invariants()
    assert alloc.match_prefix(Seq(5, [0, 1, 2, 3, 9])) == 4


def test_a_prefix_computed_twice_is_cached_once():
    alloc = PagedAllocator(num_blocks=7, block_size=4)
    a, b = _compute_twice(alloc)
    alloc.free(a)  # a's copy is redundant while b runs: it becomes empty
    alloc.free(b)
    alloc.check_invariants()
    st = alloc.stats()
    # Cached: one copy of [0, 1, 2, 3]; a's and b's partial tails are empty.
    assert (st.num_cached_blocks, st.num_empty_blocks) == (1, 5)
    (prefix_hash,) = hash_blocks([0, 1, 2, 3], 4, root_hash(NO_EXTRA_KEYS))
    assert alloc.pool.lookup(prefix_hash) == 2


def test_a_new_copy_supersedes_a_cached_one():
    alloc = PagedAllocator(num_blocks=7, block_size=4)
    first = Seq(1, [0, 1, 2, 3, 7])
    admit(alloc, first)  # block 1 holds [0, 1, 2, 3]
    late = Seq(2, [0, 1, 2, 3, 8])
    assert alloc.allocate(late, 2)  # chunked: started before `first` was freed, cannot hit
    alloc.free(first)
    assert alloc.stats().num_cached_blocks == 1
    assert alloc.allocate(late, 3)  # its block 3 fills with the prefix block 1 caches
    alloc.check_invariants()
    st = alloc.stats()
    assert st.num_cached_blocks == 0  # block 1 is empty now: block 3 holds the same KV
    assert alloc.match_prefix(Seq(3, [0, 1, 2, 3, 9])) == 4
    assert alloc.pool.free_queue()[0] == 1  # handed out next


def test_revived_blocks_keep_their_recency_and_the_queue_stays_bounded():
    pool = BlockPool(num_blocks=4, block_size=1)  # blocks 1, 2, 3
    blocks = pool.take(3)
    for b in blocks:
        pool.set_hash(b, bytes([b]) * 32)
    pool.release(reversed(blocks))  # cached, oldest first: 3, 2, 1
    for _ in range(100):  # block 2 is hit and freed again and again: the most recent
        pool.share([2])
        pool.release([2])
        pool.check_invariants()
    assert pool.free_queue() == [3, 1, 2]
    assert len(pool._cached.entries) <= 2 * pool.num_blocks + 1  # stale entries compacted
    assert pool.take(2) == [3, 1] and pool.num_evictions == 2
    assert pool.lookup(bytes([2]) * 32) == 2
    pool.check_invariants()


def test_freeing_a_shared_table_takes_the_general_path():
    alloc = PagedAllocator(num_blocks=9, block_size=4)
    a = Seq(1, list(range(10)))  # blocks 1, 2 full, 3 partial
    b = Seq(2, list(range(8)) + [99])  # hits blocks 1, 2; block 4 partial
    admit(alloc, a)
    assert admit(alloc, b) == 8
    alloc.free(a)  # blocks 1, 2 stay in use by b; only a's tail is freed
    alloc.check_invariants()
    st = alloc.stats()
    assert (st.num_used_blocks, st.num_cached_blocks, st.num_empty_blocks) == (3, 0, 5)
    alloc.free(b)
    alloc.check_invariants()
    # Empty: the tails, most recently freed first, above the never-used 5..8; then cached.
    assert alloc.pool.free_queue() == [4, 3, 5, 6, 7, 8, 2, 1]
