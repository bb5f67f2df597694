"""The allocator state machine (``test_state_machine.py``) with a small host tier attached, and a
step boundary (``drain_tier_orders``) as one more rule. Besides every allocator invariant, a
shadow of what each device block and host slot *holds* checks the step's tier orders:

* an offload reads a device block that held its hash at the start of the step;
* a load reads a host slot written by an earlier step's offload, with the right hash, and no
  offload of the same step writes that slot;
* a loaded device block is registered under the loaded hash.

Frees and swap-outs start a new step (as in ``Scheduler.schedule``, where preemptions come
before admissions and nothing admitted in a step is freed in it).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, precondition, rule

from pagedkv.kvcache import PagedAllocator
from pagedkv.kvcache.events import MEDIUM_HOST, replay
from pagedkv.kvcache.tiers.host_index import HostTierIndex

from .test_state_machine import AllocatorMachine

HOST_BLOCKS = 12  # small: the LRU pushes blocks out, and all-pinned offers are declined


class TierMachine(AllocatorMachine):
    kind = "paged16"
    # A device pool smaller than the base machine's, so that cached prefixes are evicted to
    # the host tier often and come back from it.
    pool_blocks, block_size, host_blocks = 9, 16, HOST_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PagedAllocator(self.pool_blocks, self.block_size)
        self.index = HostTierIndex(self.host_blocks)
        self.alloc.set_tiers([self.index])
        self.alloc.enable_events(self.events)
        self.host_hashes: set[bytes] = set()
        self.held = list(self.alloc.pool.block_hashes)  # device block -> hash at step start
        self.host: dict[int, bytes] = {}  # host slot -> hash written there
        self.num_loads = 0

    @rule()
    def end_step(self) -> None:
        orders = self.alloc.drain_tier_orders()
        written = set()
        for block, block_hash in orders.offloads:
            assert self.held[block] == block_hash, "offload of a block not holding its hash"
            written.add(self.index.slot_of(block_hash))
        for load in orders.loads:
            assert load.tier == "host"
            slot = self.index.slot_of(load.block_hash)
            assert slot not in written, "a load reads a slot an offload of its step writes"
            assert self.host.get(slot) == load.block_hash, "a load reads the wrong bytes"
            assert self.alloc.pool.block_hashes[load.device_block] == load.block_hash
        self.num_loads += len(orders.loads)
        for _, block_hash in orders.offloads:
            self.host[self.index.slot_of(block_hash)] = block_hash
        assert orders.saves == ()  # no tier wants write-through
        self.held = list(self.alloc.pool.block_hashes)

    @rule()
    def churn(self) -> None:
        """Every free block is taken from the pool and given back empty: each cached one is
        evicted (and offered to the host tier), as a burst of new tokens would."""
        pool = self.alloc.pool
        pool.release(pool.take(pool.num_allocatable))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempted=st.booleans())
    def free(self, data, preempted: bool) -> None:
        self.end_step()
        AllocatorMachine.free(self, data, preempted)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        self.end_step()
        AllocatorMachine.swap_out(self, data)

    def check_other_media(self, events: list) -> None:
        replay(events, self.host_hashes, MEDIUM_HOST)
        assert self.host_hashes == set(self.index.hashes())

    @invariant()
    def host_index_consistent(self) -> None:
        self.index.check_invariants()
        tiers = dict(self.alloc.stats().tier_hit_tokens)
        assert tiers["host"] == self.alloc.tiers.hit_blocks["host"] * self.alloc.block_size


class Paged4TierMachine(TierMachine):
    # 4-token blocks: more blocks per prompt, more evictions and loads per admission.
    pool_blocks, block_size, host_blocks = 33, 4, 3 * HOST_BLOCKS


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TierMachine.TestCase.settings = SETTINGS
Paged4TierMachine.TestCase.settings = SETTINGS
TestHostTier16 = TierMachine.TestCase
TestHostTier4 = Paged4TierMachine.TestCase
