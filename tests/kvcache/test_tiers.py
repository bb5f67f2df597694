"""The lower-tier protocol (``kvcache/tiers/contract.py``) through ``PagedAllocator``, with a pure-Python
fake tier and the real ``HostTierIndex``: hits hand-computed, ``check_invariants`` after every
operation."""

from __future__ import annotations

import pytest

from pagedkv.kvcache import HashExtraKeys, PagedAllocator
from pagedkv.kvcache.tiers.contract import BlockLoad, KVTier
from pagedkv.kvcache.tiers.host_index import HostTierIndex

from .conftest import Seq

B = 4


class FakeTier:
    """Holds a fixed set of hashes; records what the allocator asked."""

    def __init__(self, name: str, held=(), offloads: bool = False, saves: bool = False):
        self.name = name
        self.held = set(held)
        self.accepts_offloads = offloads
        self.wants_saves = saves
        self.event_medium = None  # reports no events (like a store)
        self.claimed: list[bytes] = []
        self.offered: list[bytes] = []
        self.steps = 0

    def enable_events(self, log, block_size) -> None:
        raise AssertionError("never called for a tier without event_medium")

    def hashes(self) -> list[bytes]:
        return []

    def match(self, block_hashes) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.held:
                break
            n += 1
        return n

    def claim(self, block_hashes) -> None:
        assert all(h in self.held for h in block_hashes)
        self.claimed.extend(block_hashes)

    def offer(self, block_hash) -> bool:
        self.offered.append(block_hash)
        if block_hash in self.held:
            return False
        self.held.add(block_hash)
        return True

    def end_step(self) -> None:
        self.steps += 1


def hashes_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """The chain hashes the allocator computes for ``tokens`` (from a scratch allocator)."""
    scratch = PagedAllocator(64, B)
    seq = Seq(999, tokens, HashExtraKeys(cache_salt=salt))
    return scratch._prompt_hashes(seq)


def admit(alloc: PagedAllocator, seq: Seq) -> int:
    hit = alloc.match_prefix(seq)
    assert alloc.allocate(seq, len(seq.token_ids) - hit, num_cached_tokens=hit)
    alloc.check_invariants()
    return hit


PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks; at most 3 blocks hit (13 // 4)


def test_the_fake_tier_satisfies_the_protocol() -> None:
    assert isinstance(FakeTier("host"), KVTier)
    assert isinstance(HostTierIndex(4), KVTier)


def test_without_tiers_nothing_changes() -> None:
    alloc = PagedAllocator(9, B)
    assert admit(alloc, Seq(1, PROMPT)) == 0
    orders = alloc.drain_tier_orders()
    assert orders.is_empty
    assert alloc.stats().tier_hit_tokens == ()


def test_a_lower_tier_continues_the_chain_and_orders_loads() -> None:
    h = hashes_of(PROMPT)
    host = FakeTier("host", held=h[:3], offloads=True)
    alloc = PagedAllocator(9, B)
    alloc.set_tiers([host])
    seq = Seq(1, PROMPT)
    assert admit(alloc, seq) == 12  # three blocks from the host tier, the last 2 tokens new
    table = list(alloc.block_table(seq))
    orders = alloc.drain_tier_orders()
    assert orders.loads == tuple(BlockLoad("host", h[i], table[i]) for i in range(3))
    assert orders.offloads == () and orders.saves == ()
    assert host.claimed == h[:3] and host.steps == 1
    assert dict(alloc.stats().tier_hit_tokens) == {"device": 0, "host": 12}
    # The loaded blocks are registered on the device: the next prompt hits them there.
    assert admit(alloc, Seq(2, PROMPT)) == 12
    assert alloc.drain_tier_orders().loads == ()
    assert dict(alloc.stats().tier_hit_tokens) == {"device": 12, "host": 12}


def test_device_then_host_then_store() -> None:
    h = hashes_of(PROMPT)
    host = FakeTier("host", held=[h[1]], offloads=True)
    store = FakeTier("store", held=[h[2]], saves=True)
    alloc = PagedAllocator(9, B)
    alloc.set_tiers([host, store])
    first = Seq(1, PROMPT[:5])  # caches block 0 on the device
    admit(alloc, first)
    alloc.free(first)
    orders = alloc.drain_tier_orders()
    assert orders.saves == ((alloc.pool.index[h[0]], h[0]),)  # write-through of block 0
    seq = Seq(2, PROMPT)
    assert admit(alloc, seq) == 12
    table = list(alloc.block_table(seq))
    orders = alloc.drain_tier_orders()
    assert orders.loads == (BlockLoad("host", h[1], table[1]), BlockLoad("store", h[2], table[2]))
    assert orders.saves == ()  # loaded blocks are not computed here: nothing to write through
    assert dict(alloc.stats().tier_hit_tokens) == {"device": 4, "host": 4, "store": 4}


def test_a_salt_isolates_the_lower_tiers_too() -> None:
    host = FakeTier("host", held=hashes_of(PROMPT, salt="a"), offloads=True)
    alloc = PagedAllocator(9, B)
    alloc.set_tiers([host])
    assert admit(alloc, Seq(1, PROMPT, HashExtraKeys(cache_salt="b"))) == 0
    assert admit(alloc, Seq(2, PROMPT, HashExtraKeys(cache_salt="a"))) == 12


def test_evicted_cached_blocks_are_offloaded_and_come_back() -> None:
    h = hashes_of(PROMPT)
    index = HostTierIndex(8)
    alloc = PagedAllocator(5, B)  # 4 usable blocks
    alloc.set_tiers([index])
    a = Seq(1, PROMPT)
    admit(alloc, a)  # 4 blocks, 3 of them full
    old = list(alloc.block_table(a))
    alloc.free(a)
    alloc.drain_tier_orders()
    other = Seq(2, list(range(500, 516)))  # 16 new tokens take all 4 blocks: 3 evictions
    assert admit(alloc, other) == 0
    index.check_invariants()
    orders = alloc.drain_tier_orders()
    assert sorted(orders.offloads) == sorted(zip(old[:3], h[:3], strict=True))
    assert sorted(index.hashes()) == sorted(h[:3])
    alloc.free(other)  # 4 more full blocks cached on the device
    back = Seq(3, PROMPT)
    assert admit(alloc, back) == 12
    orders = alloc.drain_tier_orders()
    assert [(ld.tier, ld.block_hash) for ld in orders.loads] == [("host", x) for x in h[:3]]
    # Their device blocks were the evicted cached blocks of `other`, offloaded in the same step.
    assert {b for b, _ in orders.offloads} >= {ld.device_block for ld in orders.loads}
    index.check_invariants()
    assert dict(alloc.stats().tier_hit_tokens)["host"] == 12


def test_a_refused_admission_claims_nothing() -> None:
    h = hashes_of(PROMPT)
    host = FakeTier("host", held=h[:3], offloads=True)
    alloc = PagedAllocator(3, B)  # 2 usable blocks: a 14-token prompt needs 4
    alloc.set_tiers([host])
    seq = Seq(1, PROMPT)
    hit = alloc.match_prefix(seq)
    assert hit == 12
    assert not alloc.allocate(seq, 2, num_cached_tokens=hit)
    alloc.check_invariants()
    assert host.claimed == [] and alloc.drain_tier_orders().is_empty


def test_tier_blocks_without_a_match_right_before_are_refused() -> None:
    h = hashes_of(PROMPT)
    alloc = PagedAllocator(9, B)
    alloc.set_tiers([FakeTier("host", held=h[:3], offloads=True)])
    seq = Seq(1, PROMPT)
    assert alloc.match_prefix(seq) == 12
    alloc.drain_tier_orders()  # a step boundary: the plan is gone
    with pytest.raises(ValueError, match="match_prefix again"):
        alloc.allocate(seq, 2, num_cached_tokens=12)
    alloc.check_invariants()
    assert not alloc.has_seq(seq)


def test_tiers_need_distinct_names_and_prefix_caching() -> None:
    with pytest.raises(ValueError):
        PagedAllocator(9, B).set_tiers([FakeTier("host"), FakeTier("host")])
    with pytest.raises(ValueError):
        PagedAllocator(9, B).set_tiers([FakeTier("device")])
    with pytest.raises(ValueError):
        PagedAllocator(9, B, prefix_caching=False).set_tiers([FakeTier("host")])


def test_a_tier_that_raises_is_a_miss() -> None:
    class Broken(FakeTier):
        def match(self, block_hashes) -> int:
            raise ConnectionError("down")

    h = hashes_of(PROMPT)
    store = FakeTier("store", held=h[:3])
    alloc = PagedAllocator(9, B)
    alloc.set_tiers([Broken("host", held=h[:3], offloads=True), store])
    assert admit(alloc, Seq(1, PROMPT)) == 12  # the host tier failed: the store answered
    assert [ld.tier for ld in alloc.drain_tier_orders().loads] == ["store"] * 3


# -- HostTierIndex on its own -------------------------------------------------------------


def test_host_index_lru_pins_and_pending() -> None:
    index = HostTierIndex(2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert index.offer(a) and index.slot_of(a) == 0
    assert index.match([a]) == 0  # pending: its bytes arrive when the step executes
    assert not index.offer(a)  # already held: no copy
    index.end_step()
    index.check_invariants()
    assert index.match([a, b]) == 1
    assert index.offer(b) and index.slot_of(b) == 1
    index.end_step()
    index.claim([a])  # a is now most recently used and pinned
    assert index.offer(c)  # evicts b (the LRU unpinned), reusing its slot
    assert index.slot_of(c) == 1 and b not in index and index.num_dropped == 1
    d = b"d" * 32
    assert not index.offer(d)  # a claimed, c pending: every slot pinned -> declined
    assert index.num_declined == 1
    index.check_invariants()
    index.end_step()
    assert index.offer(d) and a not in index  # a was least recently used
    index.check_invariants()
    assert index.clear() == 2 and index.num_used_blocks == 0
    index.check_invariants()
