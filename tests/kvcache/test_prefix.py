"""Prefix reuse, hand-computed: a P-token shared prefix reuses floor(P/B)*B tokens (and at most
P-1 when the prompt is the prefix itself); salts isolate tenants; eviction is lazy and ordered."""

from __future__ import annotations

import hashlib
import struct
from array import array

import pytest

from pagedkv.kvcache import (
    BlockPool,
    HashExtraKeys,
    MMSpan,
    PagedAllocator,
    RadixAllocator,
    hash_blocks,
    root_hash,
)

from .conftest import Seq, admit

BLOCK_SIZES = [1, 8, 16, 64, 128]


def make(kind: str, block_size: int, num_slots: int = 1 << 15):
    if kind == "paged":
        return PagedAllocator(num_slots // block_size, block_size)
    return RadixAllocator(num_slots, page_size=block_size)


@pytest.mark.parametrize("kind", ["paged", "radix"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("prefix_len", [1, 100, 1200, 1201])
def test_shared_prefix_reuses_whole_blocks(kind, block_size, prefix_len):
    alloc = make(kind, block_size)
    prefix = [(7 * t) % 50_000 for t in range(prefix_len)]
    first = Seq(1, prefix + [60_001, 60_002, 60_003])
    second = Seq(2, prefix + [60_100, 60_101])
    assert admit(alloc, first) == 0
    expected = (prefix_len // block_size) * block_size  # floor(P/B)*B, by hand
    assert admit(alloc, second) == expected
    alloc.check_invariants()
    # The reused blocks are the first sequence's, shared by reference count.
    n = expected // block_size
    assert list(alloc.block_table(second))[:n] == list(alloc.block_table(first))[:n]
    assert alloc.stats().prefix_hit_tokens == expected


@pytest.mark.parametrize("kind", ["paged", "radix"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_identical_prompt_recomputes_at_least_the_last_token(kind, block_size):
    alloc = make(kind, block_size)
    prompt = list(range(3, 3 + 1024))  # a multiple of every block size tested
    admit(alloc, Seq(1, prompt))
    hit = admit(alloc, Seq(2, list(prompt)))
    assert hit == ((len(prompt) - 1) // block_size) * block_size
    assert hit <= len(prompt) - 1
    alloc.check_invariants()


@pytest.mark.parametrize("kind", ["paged", "radix"])
def test_salted_request_never_hits_unsalted(kind):
    alloc = make(kind, 16)
    prompt = list(range(500))
    admit(alloc, Seq(1, prompt))
    tenant_a = HashExtraKeys(cache_salt="tenant-a")
    assert admit(alloc, Seq(2, list(prompt), tenant_a)) == 0
    assert admit(alloc, Seq(3, list(prompt), tenant_a)) == 496  # same salt: hits
    assert admit(alloc, Seq(4, list(prompt), HashExtraKeys(cache_salt="tenant-b"))) == 0
    assert admit(alloc, Seq(5, list(prompt), HashExtraKeys(lora_id="adapter-1"))) == 0
    alloc.check_invariants()


@pytest.mark.parametrize("kind", ["paged", "radix"])
def test_multimodal_span_changes_only_blocks_it_touches(kind):
    alloc = make(kind, 16)
    prompt = list(range(64))
    img_a = HashExtraKeys(mm_spans=(MMSpan("img-a", offset=40, length=8),))
    img_b = HashExtraKeys(mm_spans=(MMSpan("img-b", offset=40, length=8),))
    admit(alloc, Seq(1, prompt + [1], img_a))
    # Blocks 0 and 1 (tokens 0..31) do not overlap the image: shared; block 2 does: not shared.
    assert admit(alloc, Seq(2, prompt + [2], img_b)) == 32
    assert admit(alloc, Seq(3, prompt + [3], img_a)) == 64


def test_hashes_are_stable_and_chained():
    extra = HashExtraKeys(cache_salt="s")
    a = hash_blocks(list(range(48)), 16, root_hash(extra), extra=extra)
    b = hash_blocks(list(range(48)), 16, root_hash(extra), extra=extra)
    assert a == b and len(a) == 3 and len(set(a)) == 3
    # The same block contents after another first block hash differently (the chain).
    c = hash_blocks([99] + list(range(1, 48)), 16, root_hash(extra), extra=extra)
    assert c[1] != a[1]
    # Resuming the chain from block 1 gives the same hashes as hashing from the start.
    tail = hash_blocks(list(range(48)), 16, a[0], first_block=1, extra=extra)
    assert tail == a[1:]
    # The documented serialisation, recomputed independently: sha256(parent || uint32 LE ids).
    # A stable byte format is what lets two processes agree on a block's identity.
    root = root_hash(extra)
    expected = hashlib.sha256(root + struct.pack("<16I", *range(16))).digest()
    assert a[0] == expected
    assert root == hashlib.sha256(b"pagedkv-v1\x00lora=None\x00salt='s'").digest()


def test_freed_blocks_stay_revivable_until_handed_out():
    alloc = PagedAllocator(num_blocks=9, block_size=4)  # 8 usable blocks
    a = Seq(1, list(range(17)))  # 4 full blocks + 1 partial
    admit(alloc, a)
    alloc.free(a)
    st = alloc.stats()
    assert (st.num_cached_blocks, st.num_used_blocks) == (4, 0)
    b = Seq(2, list(range(16)) + [500])
    assert admit(alloc, b) == 16  # revived from the free queue
    alloc.check_invariants()
    assert alloc.stats().num_cached_blocks == 0


def test_eviction_order_least_recently_freed_then_tail_first():
    pool = BlockPool(num_blocks=7, block_size=1)
    first = pool.take(3)  # blocks 1, 2, 3
    second = pool.take(3)  # blocks 4, 5, 6
    for i, b in enumerate(first + second):
        pool.set_hash(b, bytes([i]) * 32)
    pool.release(reversed(first))  # a sequence frees tail first
    pool.release(reversed(second))
    pool.check_invariants()
    assert pool.free_queue() == [3, 2, 1, 6, 5, 4]
    pool.share([2])  # a prefix hit revives block 2 out of the middle of the queue
    assert pool.free_queue() == [3, 1, 6, 5, 4]
    assert pool.take(2) == [3, 1] and pool.num_evictions == 2
    assert pool.lookup(bytes([0]) * 32) is None  # block 1's hash went with it
    assert pool.lookup(bytes([1]) * 32) == 2
    pool.check_invariants()


def test_radix_evicts_least_recently_used_leaves_first():
    alloc = RadixAllocator(num_slots=13, page_size=1)  # 12 usable pages
    old, new = Seq(1, [1, 2, 3, 4, 5]), Seq(2, [1, 2, 9, 9, 9])
    admit(alloc, old)
    alloc.free(old)
    assert admit(alloc, new) == 2  # shares pages of tokens 1, 2
    alloc.free(new)
    assert alloc.stats().num_cached_blocks == 8
    # Needing 9 pages with 4 free: evicts 5 leaves, the old branch (3, 4, 5) before the new one.
    filler = Seq(3, list(range(100, 109)))
    assert alloc.allocate(filler, 9)
    alloc.check_invariants()
    probe = Seq(4, [1, 2, 9, 9, 9, 0])
    assert alloc.match_prefix(probe) == 3  # new branch kept its first page; old branch gone
    assert alloc.match_prefix(Seq(5, [1, 2, 3, 0])) == 2


def test_radix_merges_a_prefix_computed_twice_when_freed():
    alloc = RadixAllocator(num_slots=4096, page_size=16)
    shared = list(range(64))
    a = Seq(1, shared + list(range(500, 516)))  # 5 full pages, the last one its own
    b = Seq(2, shared + [7])
    assert alloc.allocate(a, 10)  # a's first prompt chunk: no full page yet
    assert admit(alloc, b) == 0  # b computes the shared 64 tokens too and enters them first
    a_pages = list(alloc.block_table(a))
    assert alloc.allocate(a, 70)  # a's second chunk meets b's copy: a keeps its own, privately
    assert list(alloc.block_table(a))[:1] == a_pages[:1]
    alloc.check_invariants()
    alloc.free(a)  # finished: a's duplicates give way to the tree's, its last page joins the tree
    alloc.check_invariants()
    assert alloc.match_prefix(Seq(3, a.token_ids + [1])) == 80
    alloc.free(b)
    alloc.check_invariants()
    assert alloc.stats().num_cached_blocks == 5  # one copy of the shared prefix, plus a's page


@pytest.mark.parametrize("kind", ["paged", "radix"])
def test_per_tenant_roots_stay_bounded(kind):
    alloc = make(kind, 4, num_slots=64)  # a tiny pool: old tenants' blocks get evicted
    for i in range(5000):
        s = Seq(i, list(range(10)), HashExtraKeys(cache_salt=f"user-{i}"))
        admit(alloc, s)
        alloc.free(s)
    alloc.check_invariants()
    assert len(alloc._roots) <= 4096
    # Tenants still cached keep their prefix.
    last = Seq(10_000, list(range(10)), HashExtraKeys(cache_salt="user-4999"))
    assert alloc.match_prefix(last) == 8


@pytest.mark.parametrize("block_size", [1, 4, 8, 128])
def test_block_hashes_agree_for_lists_and_arrays(block_size):
    # Reference: sha256(parent || little-endian uint32 token ids), built independently here.
    tokens = [(t * 2_654_435_761) % 2**32 for t in range(300)]
    root = root_hash(HashExtraKeys())
    parent, expected = root, []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *block)).digest()
        expected.append(parent)
    assert hash_blocks(tokens, block_size, root) == expected
    assert hash_blocks(array("I", tokens), block_size, root) == expected
    with pytest.raises(ValueError, match="token ids"):
        hash_blocks([0] * (block_size - 1) + [-1], block_size, root)
