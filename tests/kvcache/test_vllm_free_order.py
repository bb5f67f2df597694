"""The device pool's free order beside vLLM's, on hand-built operation streams.

Every expected free queue (the next block to be handed out first) and cached-block count below
was worked out by hand from these rules of vLLM v1 (``vllm/v1/core/block_pool.py`` and
``FreeKVCacheBlockQueue`` in ``kv_cache_utils.py``, the version that puts unhashed blocks in
front), each with its pagedkv name:

V1. A fresh pool's free queue is blocks 1 .. N-1 in id order (block 0 is the null block).
V2. ``get_new_blocks`` (``take``) pops from the front; a popped block that still holds a hash
    loses it (an eviction).
V3. ``free_blocks`` (``release``) drops one count per block; of the blocks reaching zero, those
    without a hash go to the front in the order given (the first given is the new front), those
    with one to the back in the order given. A request's blocks are passed tail first.
V4. A prefix hit (``touch`` / ``share``) takes a free block out of the queue, wherever it is.
V5. ``reset_prefix_cache`` runs only when every block is free (else it refuses and changes
    nothing), drops every hash and leaves the queue's order as it is.
V6. ``cache_full_blocks`` never de-duplicates: a block that fills with a prefix another block
    holds is indexed beside it, and both stay hashed when freed.
V7. A prompt's hit stops one token short of its end (its last token is computed for logits),
    so an identical block-aligned resend computes its last block again.

pagedkv follows V1-V5 and V7 (V5 also while sequences run: only the free cached blocks are
dropped, where vLLM refuses). It departs from V6 on purpose: a copy freed while another copy is
in use, or a cached copy superseded by a new one, becomes empty, so a prefix is never cached in
two blocks (``docs/prefix_cache.md`` says why). After every operation the pool's invariants hold
and free + in-use + cached = total.
"""

from __future__ import annotations

from pagedkv.kvcache import BlockPool, PagedAllocator

from .conftest import Seq, admit


def _check(alloc: PagedAllocator, free_queue: list[int], num_cached: int) -> None:
    alloc.check_invariants()
    st = alloc.stats()
    assert st.num_empty_blocks + st.num_used_blocks + st.num_cached_blocks == st.num_total_blocks
    assert alloc.pool.free_queue() == free_queue
    assert st.num_cached_blocks == num_cached


def test_one_release_hands_out_its_empty_blocks_in_the_order_given():
    pool = BlockPool(num_blocks=7, block_size=1)  # V1: [1, 2, 3, 4, 5, 6]
    assert pool.take(3) == [1, 2, 3]
    pool.set_hash(1, b"\x01" * 32)
    pool.release([3, 2, 1])  # V3: 3, 2 in front as given; 1 (hashed) at the back
    pool.check_invariants()
    assert pool.free_queue() == [3, 2, 4, 5, 6, 1]
    assert pool.take(2) == [3, 2] and pool.num_evictions == 0
    pool.release([2, 3])  # V3: in front of 4, 2 first
    pool.check_invariants()
    assert pool.free_queue() == [2, 3, 4, 5, 6, 1]


def test_a_reset_keeps_the_free_order():
    # Before the rule, the reset pushed the dropped blocks in front ([4, 1, 2, 5, 3, 6, 7, 8]),
    # and z below took 4, 1, 2, 5 where vLLM takes 5, 3, 6, 7.
    alloc = PagedAllocator(num_blocks=9, block_size=4)  # V1: blocks 1..8
    x, y = Seq(1, list(range(10))), Seq(2, list(range(100, 106)))
    admit(alloc, x)  # blocks 1, 2 full (hashed), 3 partial
    admit(alloc, y)  # block 4 full, 5 partial
    _check(alloc, [6, 7, 8], 0)
    alloc.free(x)  # V3, given [3, 2, 1]: 3 in front, 2 and 1 at the back
    _check(alloc, [3, 6, 7, 8, 2, 1], 2)
    alloc.free(y)  # given [5, 4]
    _check(alloc, [5, 3, 6, 7, 8, 2, 1, 4], 3)
    assert alloc.reset_prefix_cache() == 3  # V5: every hash gone, nothing moves
    _check(alloc, [5, 3, 6, 7, 8, 2, 1, 4], 0)
    z = Seq(3, list(range(200, 213)))  # 4 blocks: 3 full, 1 partial
    assert admit(alloc, z) == 0
    assert alloc.block_table(z) == [5, 3, 6, 7]  # V2 from the front, no eviction
    _check(alloc, [8, 2, 1, 4], 0)
    assert alloc.match_prefix(Seq(4, list(range(10)))) == 0
    alloc.free(z)  # given [7, 6, 3, 5]: 7 in front, 6, 3, 5 at the back
    _check(alloc, [7, 8, 2, 1, 4, 6, 3, 5], 3)


def test_a_reset_while_a_sequence_runs_drops_only_the_free_cached_blocks():
    # vLLM refuses this reset (V5) and keeps its 2 cached blocks; pagedkv drops them and keeps
    # the hash of the block in use, whose prefix is still being served.
    alloc = PagedAllocator(num_blocks=9, block_size=4)
    x, y = Seq(1, list(range(10))), Seq(2, list(range(100, 106)))
    admit(alloc, x)
    admit(alloc, y)
    alloc.free(x)
    _check(alloc, [3, 6, 7, 8, 2, 1], 2)
    assert alloc.reset_prefix_cache() == 2
    _check(alloc, [3, 6, 7, 8, 2, 1], 0)
    assert alloc.match_prefix(Seq(3, list(range(100, 105)))) == 4  # y's block 4, in use
    alloc.free(y)  # given [5, 4]: 4 still hashed, to the back
    _check(alloc, [5, 3, 6, 7, 8, 2, 1, 4], 1)


def test_an_identical_resend_caches_its_prefix_once():
    alloc = PagedAllocator(num_blocks=7, block_size=4)  # blocks 1..6
    a = Seq(1, list(range(8)))  # two full blocks: 1, 2
    admit(alloc, a)
    alloc.free(a)  # given [2, 1], both hashed: to the back
    _check(alloc, [3, 4, 5, 6, 2, 1], 2)
    b = Seq(2, list(range(8)))
    assert admit(alloc, b) == 4  # V7: block 1 is hit (V4), block 3 computes block 2's prefix
    assert alloc.block_table(b) == [1, 3]
    # vLLM (V6): block 2 stays cached beside block 3: [4, 5, 6, 2] with 1 cached block.
    # pagedkv: block 3 supersedes block 2, which is empty now, in front.
    _check(alloc, [2, 4, 5, 6], 0)
    alloc.free(b)  # given [3, 1], both hashed
    # vLLM: [4, 5, 6, 2, 3, 1] with 3 cached blocks (2 and 3 hold the same prefix).
    _check(alloc, [2, 4, 5, 6, 3, 1], 2)
    assert alloc.match_prefix(Seq(3, list(range(8)) + [99])) == 8  # the same prefixes in both


def test_a_unique_prefix_outlives_a_redundant_copy():
    # Why pagedkv leaves V6: vLLM's second copy of a prefix stands in the cached order beside
    # unique prefixes, and one is evicted in its place.
    alloc = PagedAllocator(num_blocks=9, block_size=4)  # blocks 1..8
    u = Seq(1, [50, 51, 52, 53, 54])  # block 1 full (a prefix only u holds), 2 partial
    a, b = Seq(2, list(range(8))), Seq(3, list(range(8)))
    admit(alloc, u)
    admit(alloc, a)  # blocks 3, 4
    assert admit(alloc, b) == 4  # V7: hits block 3; block 5 computes block 4's prefix again
    assert alloc.block_table(b) == [3, 5]
    _check(alloc, [6, 7, 8], 0)
    alloc.free(u)  # given [2, 1]
    _check(alloc, [2, 6, 7, 8, 1], 1)
    alloc.free(b)  # given [5, 3]: 3 stays in use by a
    # vLLM: 5 keeps its hash and goes to the back: [2, 6, 7, 8, 1, 5].
    _check(alloc, [5, 2, 6, 7, 8, 1], 1)
    alloc.free(a)  # given [4, 3]
    # vLLM: [2, 6, 7, 8, 1, 5, 4, 3] with 4 cached blocks for 3 prefixes.
    _check(alloc, [5, 2, 6, 7, 8, 1, 4, 3], 3)
    filler = Seq(4, list(range(1000, 1020)))  # 5 blocks
    assert admit(alloc, filler) == 0
    # vLLM takes 2, 6, 7, 8, 1 and evicts u's prefix (block 1): a hit of 0 below.
    assert alloc.block_table(filler) == [5, 2, 6, 7, 8]
    assert alloc.stats().num_evictions == 0
    _check(alloc, [1, 4, 3], 3)
    assert alloc.match_prefix(Seq(5, [50, 51, 52, 53, 99])) == 4
