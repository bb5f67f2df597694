"""Bad input raises a clear ValueError and leaves the allocator consistent."""

from __future__ import annotations

import pytest

from pagedkv.kvcache import (
    BlockPool,
    PagedAllocator,
    RadixAllocator,
    ReservedAllocator,
    build_allocator,
    get_policy,
)
from pagedkv.kvcache.hashing import get_hash_fn

from .conftest import Seq, admit


@pytest.mark.parametrize(
    "ctor, match",
    [
        (lambda: PagedAllocator(16, 0), "block_size"),
        (lambda: PagedAllocator(16, -3), "block_size"),
        (lambda: PagedAllocator(1, 16), "num_blocks"),
        (lambda: PagedAllocator(16, 2.5), "block_size"),
        (lambda: BlockPool(0, 16), "num_blocks"),
        (lambda: RadixAllocator(16, page_size=0), "page_size"),
        (lambda: RadixAllocator(1, page_size=1), "at least 2 pages"),
        (lambda: ReservedAllocator(100, 0), "max_model_len"),
        (lambda: ReservedAllocator(100, 200), "cannot hold one region"),
        (lambda: PagedAllocator(16, 16, hash_algorithm="md5"), "unknown block hash"),
        (lambda: get_policy("vllm2"), "unknown policy"),
        (lambda: get_policy("paged:0"), "unknown policy"),
        (lambda: build_allocator("vllm", num_slots=16, max_model_len=64), "num_blocks"),
    ],
)
def test_constructor_errors_are_clear(ctor, match):
    with pytest.raises(ValueError, match=match):
        ctor()


def test_hash_choices_are_named():
    with pytest.raises(ValueError, match="sha256"):
        get_hash_fn("crc")


def test_misuse_raises_and_leaves_state_consistent(make_alloc):
    alloc = make_alloc(4096)
    s = Seq(1, list(range(40)))
    admit(alloc, s)
    snapshot = alloc.stats()
    ghost = Seq(99, [1, 2, 3])
    for bad in (
        lambda: alloc.free(ghost),  # never admitted
        lambda: alloc.allocate(s, -1),  # negative growth
        lambda: alloc.allocate(s, 5),  # tokens not appended yet
        lambda: alloc.allocate(s, 1, num_cached_tokens=16),  # already admitted
        lambda: alloc.slot_mapping(s, 0, 41),  # past the allocated tokens
        lambda: alloc.fork(ghost, Seq(100, [1, 2, 3])),  # unknown parent
        lambda: alloc.fork(s, s),  # child already allocated
        lambda: alloc.fork(s, Seq(101, [5] * 40)),  # child does not start like the parent
    ):
        with pytest.raises(ValueError):
            bad()
        alloc.check_invariants()
        assert alloc.stats() == snapshot
    alloc.free(s)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(s)  # freed twice
    s.token_ids.append(7)
    with pytest.raises(ValueError, match="growing a freed sequence"):
        alloc.allocate(s, 1)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.slot_mapping(s, 0, 1)
    alloc.check_invariants()
    assert alloc.stats().num_used_blocks == 0


@pytest.mark.parametrize("kind", ["paged", "radix"])
def test_stale_or_bogus_prefix_claim_is_refused(kind):
    alloc = PagedAllocator(64, 16) if kind == "paged" else RadixAllocator(1024, 16)
    s = Seq(1, list(range(40)))
    with pytest.raises(ValueError, match="multiple of"):
        alloc.allocate(s, 30, num_cached_tokens=10)
    with pytest.raises(ValueError, match="stale"):
        alloc.allocate(s, 8, num_cached_tokens=32)  # nothing is cached: the claim is false
    alloc.check_invariants()
    assert alloc.stats().num_used_blocks == 0 and not alloc.has_seq(s)


def test_preempted_sequence_may_be_admitted_again(make_alloc):
    alloc = make_alloc(4096)
    s = Seq(1, list(range(40)))
    admit(alloc, s)
    alloc.free(s, preempted=True)
    admit(alloc, s)  # recompute after preemption: a legitimate re-admission
    alloc.check_invariants()
    assert alloc.num_tokens(s) == 40
