"""The allocator state machine (``test_state_machine.py``) over paged allocators with partial-block
prefix reuse (a prefix match unit below the block size), with a shadow of what every device
block and host block *holds*: the token whose KV each slot was written with.

Steps are explicit: admissions and growth only order their writes (the forward pass of the
step), and ``end_step`` drains the step's orders, applies the partial hits' prefix copies (which
read their sources *before* the step's writes, as the engine copies before the forward pass),
then the writes. Frees, forks and swaps start a new step (as in ``Scheduler.schedule``, where
the step's forward ends before ``update`` frees or forks anything). After every step:

* every slot of every live sequence holds the KV of its own token: a prefix hit, whole or
  partial, claimed or copied, reused exactly the right tokens, to the last one;
* no write and no copy lands in a block another live sequence holds (no shared block is
  written), and a copy's source is a full, indexed block;
* besides every invariant of the base machine (no block leaked, pins counted, events replay).

The same rules with a host tier attached (``test_tier_state_machine.py``) check that a block
claimed in place is offered to the host tier like an eviction.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import precondition, rule

from pagedkv.kvcache import PagedAllocator

from .conftest import Seq
from .test_state_machine import AllocatorMachine
from .test_tier_state_machine import TierMachine


class PartialMachine(AllocatorMachine):
    kind = "paged16-u1"

    def __init__(self) -> None:
        super().__init__()
        bs = self.alloc.block_size
        self.content: dict[int, list[int | None]] = {}  # device block -> token per slot
        self.host_content: dict[int, list[int | None]] = {}
        self.pending: list[tuple[int, list[int], list[int]]] = []  # seq id, slots, tokens
        self.empty = [None] * bs
        self.num_copies = self.num_claims = 0

    def _block(self, block: int) -> list[int | None]:
        return self.content.setdefault(block, list(self.empty))

    def _check_write(self, block: int, offset: int, token: int | None, writer: int) -> None:
        """A write into ``block`` may only give a slot the token every *other* live holder
        reads there (a block registered this step is shared before its forward writes it:
        the same KV); it never changes what another sequence reads."""
        bs = self.alloc.block_size
        for sid, seq in self.live.items():
            table = self.alloc.block_table(seq)
            if sid == writer or block not in table:
                continue
            pos = table.index(block) * bs + offset
            if pos < self.alloc.num_tokens(seq):
                assert seq.token_ids[pos] == token, f"a write changes what seq {sid} reads"

    # -- the base machine's hooks ----------------------------------------------------------

    def computes(self, seq: Seq, start: int, end: int) -> None:
        slots = self.alloc.slot_mapping(seq, start, end)
        self.pending.append((seq.seq_id, slots, list(seq.token_ids[start:end])))

    def copied(self, pairs, to_host: bool = False, from_host: bool = False) -> None:
        for src, dst in pairs:
            if to_host:
                self.host_content[dst] = list(self._block(src))
            elif from_host:
                self.content[dst] = list(self.host_content[src])
            else:
                self.content[dst] = list(self._block(src))

    # -- steps -----------------------------------------------------------------------------

    @rule()
    def end_step(self) -> None:
        bs = self.alloc.block_size
        # The hashes as the step's orders were made: draining releases the copy sources' pins,
        # and a source whose hash this step's recomputed block now also holds leaves the index
        # then (its slots intact: nothing is allocated between the drain and the copies).
        hashes = list(self.alloc.pool.block_hashes)
        orders = self.alloc.drain_tier_orders()
        for src, dst, n in orders.prefix_copies:
            assert 0 < n < bs
            assert hashes[src] is not None, "copy from an unindexed block"
            source = self._block(src)[:n]
            assert None not in source, "a prefix copy reads slots nobody wrote yet"
            owners = [sid for sid, q in self.live.items() if dst in self.alloc.block_table(q)]
            owner = owners[0]  # the admitted sequence (others only share it if it filled)
            for offset, token in enumerate(source):
                self._check_write(dst, offset, token, owner)
            self._block(dst)[:n] = source
            self.num_copies += 1
        for sid, slots, tokens in self.pending:
            for slot, token in zip(slots, tokens, strict=True):
                block = slot // bs
                self._check_write(block, slot % bs, token, sid)
                self._block(block)[slot % bs] = token
        self.pending.clear()
        for sid, seq in self.live.items():
            n = self.alloc.num_tokens(seq)
            slots = self.alloc.slot_mapping(seq, 0, n)
            held = [self._block(s // bs)[s % bs] for s in slots]
            assert held == list(seq.token_ids[:n]), f"seq {sid} reads KV of other tokens"
        self.num_claims = self.alloc.stats().num_partial_claims

    # Frees, forks and swaps come after the step's forward pass: a new step starts.
    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempted=st.booleans())
    def free(self, data, preempted: bool) -> None:
        self.end_step()
        AllocatorMachine.free(self, data, preempted)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data) -> None:
        self.end_step()
        AllocatorMachine.fork(self, data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        self.end_step()
        AllocatorMachine.swap_out(self, data)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), grow=st.integers(1, 20))
    def swap_in(self, data, grow: int) -> None:
        self.end_step()
        AllocatorMachine.swap_in(self, data, grow)

    @rule()
    def reset_cache(self) -> None:  # between steps, as the engine resets it
        self.end_step()
        AllocatorMachine.reset_cache(self)

    def teardown(self) -> None:
        self.end_step()
        assert self.alloc.stats().num_partial_hits >= self.num_copies
        super().teardown()


class Partial8Unit4Machine(PartialMachine):
    kind = "paged8-u4"


class PartialTierMachine(TierMachine):
    """The host-tier machine over an allocator matching single tokens inside 4-token blocks:
    claims in place are offered to the host tier like evictions; loads and copies mix."""

    pool_blocks, block_size, host_blocks = 33, 4, 36

    def __init__(self) -> None:
        super().__init__()
        from pagedkv.kvcache.tiers.host_index import HostTierIndex

        self.alloc = PagedAllocator(self.pool_blocks, self.block_size, prefix_match_unit=1)
        self.index = HostTierIndex(self.host_blocks)
        self.alloc.set_tiers([self.index])
        self.alloc.enable_events(self.events)
        self.held = list(self.alloc.pool.block_hashes)

    @rule()
    def reset_cache(self) -> None:  # between steps, as the engine resets it
        self.end_step()
        AllocatorMachine.reset_cache(self)

    def teardown(self) -> None:
        self.end_step()
        super().teardown()


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
for _machine in (PartialMachine, Partial8Unit4Machine, PartialTierMachine):
    _machine.TestCase.settings = SETTINGS
TestPartial16Unit1 = PartialMachine.TestCase
TestPartial8Unit4 = Partial8Unit4Machine.TestCase
TestPartialHostTier4Unit1 = PartialTierMachine.TestCase
