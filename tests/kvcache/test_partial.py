"""Partial-block prefix reuse (``kvcache/partial.py``), case by case, every expected value worked
out by hand from the prompts: the match in units of U, claim in place against copy (TRT-LLM's
rule), blocks computed in the same step never a source, the plan checked at admission, tenants
and media kept apart, kept partial tails, events with token ids, the host tier, swap-in."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from pagedkv.kvcache import HashExtraKeys, MMSpan, PagedAllocator
from pagedkv.kvcache.events import BlockStored, KVEventBatch, KVEventLog, replay
from pagedkv.kvcache.hashing import token_bytes
from pagedkv.kvcache.sibling_index import SiblingIndex, common_prefix_tokens
from pagedkv.kvcache.tiers.contract import PrefixCopy
from pagedkv.kvcache.tiers.host_index import HostTierIndex
from pagedkv.kvcache.tiers.swap_space import SwapSpace, swap_in, swap_out

from .conftest import Seq, admit

B = 8
STEM = list(range(100, 113))  # 13 tokens: block 0 whole, 5 tokens into block 1


def _alloc(num_blocks: int = 16, unit: int = 1) -> PagedAllocator:
    return PagedAllocator(num_blocks, B, prefix_match_unit=unit)


def _step(alloc: PagedAllocator) -> tuple[PrefixCopy, ...]:
    """End a scheduler step: the step's prefix copies (and pins released)."""
    copies = alloc.drain_tier_orders().prefix_copies
    alloc.check_invariants()
    return copies


# -- the index --------------------------------------------------------------------------------


def test_common_prefix_counts_whole_tokens():
    a = token_bytes([1, 2, 3, 256])
    assert common_prefix_tokens(a, token_bytes([1, 2, 3, 512])) == 3  # first byte equal
    assert common_prefix_tokens(a, token_bytes([1, 2])) == 2
    assert common_prefix_tokens(a, a) == 4
    assert common_prefix_tokens(a, token_bytes([9])) == 0


@given(
    children=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12),
    query=st.lists(st.integers(0, 3), min_size=1, max_size=6),
)
def test_the_two_neighbours_hold_the_longest_shared_prefix(children, query):
    index = SiblingIndex()
    for i, tokens in enumerate(children):
        index.add(b"p", b"c%d" % i, token_bytes(tokens))
    brute = max((_shared(t, query) for t in children), default=0)
    got = index.candidates(b"p", token_bytes(query))
    assert (got[0][0] if got else 0) == brute


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- the match and the admission --------------------------------------------------------------


@pytest.mark.parametrize(("unit", "want"), [(1, 13), (2, 12), (4, 12), (8, 8)])
def test_a_hit_ends_inside_a_block_at_a_multiple_of_the_unit(unit, want):
    alloc = _alloc(unit=unit)
    first = Seq(1, STEM + [1, 2, 3, 4, 5])  # 18 tokens: blocks 0 and 1 full
    admit(alloc, first)
    _step(alloc)
    second = Seq(2, STEM + [7, 7, 7, 7])  # shares 13 tokens with the first
    assert admit(alloc, second) == want
    copies = _step(alloc)
    if want % B:
        # The first still holds its block 1: copied into the second's fresh block 1.
        src, dst = alloc.block_table(first)[1], alloc.block_table(second)[1]
        assert copies == (PrefixCopy(src, dst, want % B),)
    else:
        assert copies == ()
    s = alloc.stats()
    assert (s.partial_hit_tokens, s.partial_copied_tokens) == (want % B, want % B)
    assert s.prefix_hit_tokens == want and s.num_partial_claims == 0


def test_an_unused_leaf_is_claimed_in_place_and_a_block_with_a_child_is_copied():
    alloc = _alloc()
    first = Seq(1, STEM + [1, 2, 3])  # 16 tokens: two full blocks, no tail
    admit(alloc, first)
    _step(alloc)
    block1 = alloc.block_table(first)[1]
    alloc.free(first)  # block 1 is cached, unreferenced, and nothing follows it: a leaf
    second = Seq(2, STEM + [9, 9])
    assert admit(alloc, second) == 13
    assert alloc.block_table(second)[1] == block1  # the same block: its 5 slots kept
    assert _step(alloc) == ()
    s = alloc.stats()
    assert s.num_partial_claims == 1 and s.partial_copied_tokens == 0
    assert block1 not in alloc.pool.index.values()  # its hash left with the claim

    alloc2 = _alloc()
    parent = Seq(3, STEM + [1, 2, 3] + [4] * 8)  # three full blocks: block 1 has a child
    admit(alloc2, parent)
    _step(alloc2)
    alloc2.free(parent)
    third = Seq(4, STEM + [9, 9])
    assert admit(alloc2, third) == 13
    (copy,) = _step(alloc2)
    assert copy.num_tokens == 5 and copy.src_block != copy.dst_block
    # The source went back to the cache beside block 2 (block 0 is the third's now).
    assert alloc2.stats().num_cached_blocks == 2


def test_blocks_computed_in_the_same_step_are_no_copy_source():
    alloc = _alloc()
    first, second = Seq(1, STEM + [1, 2, 3]), Seq(2, STEM + [5, 5])
    admit(alloc, first)  # its block 1 is filled by this step's forward pass, after copies
    assert alloc.match_prefix(second) == B  # whole block 0 only (a full hit is fine)
    _step(alloc)
    assert alloc.match_prefix(second) == 13  # next step: block 1 is written


def test_the_admission_checks_the_partial_plan():
    alloc = _alloc()
    admit(alloc, Seq(1, STEM + [1, 2, 3]))
    _step(alloc)
    second = Seq(2, STEM + [9, 9])
    with pytest.raises(ValueError, match="not matched right before"):
        alloc.allocate(second, 2, num_cached_tokens=13)  # no match_prefix first
    assert alloc.match_prefix(second) == 13
    with pytest.raises(ValueError, match="not matched right before"):
        alloc.allocate(second, 1, num_cached_tokens=14)  # more than matched
    alloc.check_invariants()
    assert alloc.match_prefix(second) == 13
    assert alloc.allocate(second, 4, num_cached_tokens=11)  # less than matched: fine
    assert alloc.stats().partial_hit_tokens == 3


def test_tenants_and_media_are_never_matched_partially():
    alloc = _alloc()
    admit(alloc, Seq(1, STEM + [1, 2, 3]))
    _step(alloc)
    salted = Seq(2, STEM + [9, 9], HashExtraKeys(cache_salt="other"))
    assert alloc.match_prefix(salted) == 0
    span = HashExtraKeys(mm_spans=(MMSpan("img", 9, 2),))  # inside block 1, not block 0
    assert alloc.match_prefix(Seq(3, STEM + [9, 9], span)) == B  # block 1 is not reused


def test_a_freed_sequences_partial_tail_is_kept_and_claimed_by_the_next_turn():
    alloc = _alloc()
    turn1 = Seq(1, STEM + [1])  # 14 tokens: block 1 holds 6
    admit(alloc, turn1)
    _step(alloc)
    tail = alloc.block_table(turn1)[1]
    alloc.free(turn1)
    assert alloc.stats().num_cached_blocks == 2  # block 0 and the kept tail
    turn2 = Seq(2, STEM + [1, 42, 43])  # repeats all 14 tokens
    assert admit(alloc, turn2) == 14
    assert alloc.block_table(turn2)[1] == tail and _step(alloc) == ()
    assert alloc.stats().num_partial_claims == 1


def test_a_prompt_seen_in_full_still_recomputes_its_last_token():
    alloc = _alloc()
    admit(alloc, Seq(1, STEM + [1, 2, 3]))
    _step(alloc)
    assert alloc.match_prefix(Seq(2, STEM)) == 12  # 13 tokens: the last one is computed


# -- events, tiers, swap ----------------------------------------------------------------------


def test_events_carry_token_ids_with_partial_reuse_only():
    alloc = _alloc()
    log = KVEventLog()
    alloc.enable_events(log)
    admit(alloc, Seq(1, STEM + [1, 2, 3]))
    (stored,) = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert stored.token_ids == tuple(STEM + [1, 2, 3]) and stored.num_tokens == 16
    again = KVEventBatch.from_json(KVEventBatch(0.0, (stored,)).to_json()).events[0]
    assert again == stored

    whole = PagedAllocator(16, B)  # U = B: the events are those of before, no token ids
    log2 = KVEventLog()
    whole.enable_events(log2)
    admit(whole, Seq(1, STEM + [1, 2, 3]))
    text = KVEventBatch(0.0, tuple(log2.drain())).to_json()
    assert "token_ids" not in text


def test_a_kept_tail_is_reported_with_its_tokens_and_removed_when_claimed():
    alloc = _alloc()
    log, held = KVEventLog(), set()
    alloc.enable_events(log)
    first = Seq(1, STEM + [1])
    admit(alloc, first)
    _step(alloc)
    alloc.free(first)
    events = log.drain()
    replay(events, held)
    tail = [e for e in events if isinstance(e, BlockStored) and e.num_tokens < B]
    assert [e.token_ids for e in tail] == [tuple(STEM[8:] + [1])]
    admit(alloc, Seq(2, STEM + [1, 5]))
    replay(log.drain(), held)
    assert held == alloc.prefix_hashes()


def test_a_claimed_block_goes_to_the_host_tier_like_an_eviction_and_a_tail_never():
    alloc = _alloc()
    host = HostTierIndex(8)
    alloc.set_tiers([host])
    first = Seq(1, STEM + [1, 2, 3])
    admit(alloc, first)
    _step(alloc)
    block1, hash1 = (
        alloc.block_table(first)[1],
        alloc.pool.block_hashes[alloc.block_table(first)[1]],
    )
    alloc.free(first)
    admit(alloc, Seq(2, STEM + [9, 9]))  # claims block 1 in place
    assert alloc.drain_tier_orders().offloads == ((block1, hash1),)
    tail_owner = Seq(3, STEM + [4])  # block 1 holds 6 tokens when freed: a kept tail
    admit(alloc, tail_owner)
    alloc.drain_tier_orders()
    alloc.free(tail_owner)
    assert alloc.partial is not None
    (tail_key,) = alloc.partial.tails
    evictions = alloc.stats().num_evictions
    alloc.pool.release(alloc.pool.take(alloc.pool.num_allocatable))  # evict everything cached
    assert alloc.stats().num_evictions == evictions + 1  # the tail, dropped
    assert alloc.drain_tier_orders().offloads == ()  # not offered
    assert tail_key not in host.hashes() and not alloc.partial.tails
    alloc.check_invariants()


def test_swap_in_takes_whole_blocks_from_the_cache_and_the_rest_from_the_host():
    alloc = _alloc()
    space = SwapSpace(4)
    other = Seq(1, STEM + [1, 2, 3])  # holds block 1, which the swapped one shares 5 tokens of
    admit(alloc, other)
    _step(alloc)
    seq = Seq(2, STEM + [9, 9])  # 15 tokens: block 1 holds 7
    admit(alloc, seq)
    _step(alloc)
    host = swap_out(alloc, space, seq, 15)  # its tail is kept in the cache too
    assert host is not None
    hits = alloc.stats().num_partial_hits
    seq.token_ids.append(10)
    start, num_new, copies = swap_in(alloc, space, seq, 15, 1)  # matches 15: rounded to 8
    assert (start, num_new) == (15, 1)
    assert copies == [(host[1][1], alloc.block_table(seq)[1])]  # block 1 from the host, whole
    assert _step(alloc) == () and alloc.stats().num_partial_hits == hits


def test_units_that_do_not_divide_the_block_are_refused():
    with pytest.raises(ValueError, match="must divide the block size"):
        PagedAllocator(8, 8, prefix_match_unit=3)
    with pytest.raises(ValueError, match=">= 1"):
        PagedAllocator(8, 8, prefix_match_unit=0)
    with pytest.raises(ValueError, match="needs prefix caching"):
        PagedAllocator(8, 8, prefix_caching=False, prefix_match_unit=1)
