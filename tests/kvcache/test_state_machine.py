"""Random admit / grow / fork / free / evict / swap-out / swap-in sequences against every
allocator and a host swap space, with ``check_invariants()`` after every step, including the
exhaustion and refusal paths.

A shadow model tracks what each live sequence must hold (its tokens and their slots); the
allocator must agree with it after every operation.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.kvcache import HashExtraKeys, ReservedAllocator
from pagedkv.kvcache.allocator_base import ceil_div
from pagedkv.kvcache.events import KVEventLog, replay
from pagedkv.kvcache.tiers.swap_space import SwapSpace, swap_in, swap_out

from .conftest import FACTORIES, Seq

# Small pools so that exhaustion, refusal and eviction happen often.
POOL_SLOTS = {"reserved": 1024}
DEFAULT_POOL_SLOTS = 320

# Prompts drawn from a few shared stems, so prefix hits and divergence both happen.
STEMS = [list(range(100, 140)), list(range(100, 120)) + list(range(500, 520)), [7] * 33]


class AllocatorMachine(RuleBasedStateMachine):
    kind = "paged16"

    def __init__(self) -> None:
        super().__init__()
        self.alloc = FACTORIES[self.kind](POOL_SLOTS.get(self.kind, DEFAULT_POOL_SLOTS))
        self.live: dict[int, Seq] = {}
        self.slots: dict[int, list[int]] = {}  # shadow: the slots each live seq was given
        self.next_id = 0
        # A small swap space, so that a full one (the recompute fallback) happens too.
        self.space = SwapSpace(max(6, 192 // self.alloc.block_size))
        self.swapped: dict[int, tuple[Seq, int, list[int]]] = {}  # seq, tokens, host blocks
        # KV events: replayed in order, they must give the hashes the prefix cache holds.
        self.events = KVEventLog()
        self.alloc.enable_events(self.events)
        self.held_hashes: set[bytes] = {b"stale"}  # AllBlocksCleared must come first

    @initialize()
    def start(self) -> None:
        self.alloc.check_invariants()

    def _new_seq(self, stem: int, tail: int, salt: bool) -> Seq:
        self.next_id += 1
        tokens = STEMS[stem] + [1000 + self.next_id * 7 + i for i in range(tail)]
        extra = HashExtraKeys(cache_salt="t1") if salt else HashExtraKeys()
        return Seq(self.next_id, tokens, extra)

    @rule(stem=st.integers(0, 2), tail=st.integers(0, 70), salt=st.booleans(), chunk=st.booleans())
    def admit(self, stem: int, tail: int, salt: bool, chunk: bool) -> None:
        seq = self._new_seq(stem, tail, salt)
        hit = self.alloc.match_prefix(seq)
        assert 0 <= hit <= max(len(seq.token_ids) - 1, 0)
        assert hit % getattr(self.alloc, "prefix_match_unit", self.alloc.block_size) == 0
        n = len(seq.token_ids) - hit
        if chunk:
            n = max(1, n // 2)  # chunked prefill: admit part of the prompt first
        before = self.alloc.stats()
        if self.alloc.allocate(seq, n, num_cached_tokens=hit):
            self.live[seq.seq_id] = seq
            self.slots[seq.seq_id] = self.alloc.slot_mapping(seq, 0, hit + n)
            self.computes(seq, hit, hit + n)
        else:  # refused: nothing changed
            after = self.alloc.stats()
            assert after.num_empty_blocks + after.num_cached_blocks >= 0
            assert (after.num_used_blocks, after.num_seqs) == (
                before.num_used_blocks,
                before.num_seqs,
            )
            assert not self.alloc.has_seq(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), grow=st.integers(1, 40))
    def grow(self, data, grow: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[sid]
        have = self.alloc.num_tokens(seq)
        missing = have + grow - len(seq.token_ids)
        if missing > 0:
            seq.token_ids.extend(2000 + sid * 31 + i for i in range(missing))
        table_before = list(self.alloc.block_table(seq))
        if self.alloc.allocate(seq, grow):
            new = self.alloc.slot_mapping(seq, 0, have + grow)
            assert new[:have] == self.slots[sid], "growth moved already-written tokens"
            self.slots[sid] = new
            self.computes(seq, have, have + grow)
        else:
            assert list(self.alloc.block_table(seq)) == table_before
            assert self.alloc.num_tokens(seq) == have

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        parent = self.live[sid]
        n = self.alloc.num_tokens(parent)
        self.next_id += 1
        child = Seq(self.next_id, list(parent.token_ids[:n]), parent.extra_keys)
        copies = self.alloc.fork(parent, child)
        if copies is None:
            assert not self.alloc.has_seq(child)
            return
        self.live[child.seq_id] = child
        self.slots[child.seq_id] = self.alloc.slot_mapping(child, 0, n)
        for src, dst in copies:
            assert src in self.alloc.block_table(parent) and dst in self.alloc.block_table(child)
        self.copied(copies)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempted=st.booleans())
    def free(self, data, preempted: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(self.live.pop(sid), preempted=preempted)
        del self.slots[sid]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[sid]
        n = self.alloc.num_tokens(seq)
        table = list(self.alloc.block_table(seq))
        free_before = self.space.num_free_blocks
        pairs = swap_out(self.alloc, self.space, seq, n)
        if pairs is None:  # the swap space is full: nothing changed, the caller recomputes
            assert ceil_div(n, self.alloc.block_size) > free_before
            assert list(self.alloc.block_table(seq)) == table
            assert self.space.num_free_blocks == free_before and not self.space.holds(sid)
            return
        assert [d for d, _ in pairs] == table  # every block, in logical order
        host = [h for _, h in pairs]
        assert len(set(host)) == len(host) and all(0 <= h < self.space.num_blocks for h in host)
        assert not self.alloc.has_seq(seq)
        del self.live[sid], self.slots[sid]
        self.swapped[sid] = (seq, n, host)
        self.copied(pairs, to_host=True)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), grow=st.integers(1, 20))
    def swap_in(self, data, grow: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        seq, n, host = self.swapped[sid]
        missing = n + grow - len(seq.token_ids)
        if missing > 0:
            seq.token_ids.extend(3000 + sid * 31 + i for i in range(missing))
        back = swap_in(self.alloc, self.space, seq, n, grow)
        if back is None:  # no room on the device: it stays in the swap space
            assert self.space.blocks_of(sid) == host and not self.alloc.has_seq(seq)
            return
        start, num_new, copies = back
        bs = self.alloc.block_size
        assert start == n or (start > n and start % bs == 0)  # a hit past it: whole blocks
        assert 1 <= num_new <= grow and self.alloc.num_tokens(seq) == start + num_new
        table = self.alloc.block_table(seq)
        # Each copied host block lands at its own logical index; the rest came from the cache.
        first = len(host) - len(copies)
        assert copies == [(host[i], table[i]) for i in range(first, len(host))]
        assert first * bs <= start
        assert not self.space.holds(sid)
        del self.swapped[sid]
        self.live[sid] = seq
        self.slots[sid] = self.alloc.slot_mapping(seq, 0, start + num_new)
        self.copied(copies, from_host=True)
        self.computes(seq, start, start + num_new)

    # Hooks of a machine that models what blocks hold (``test_partial_state_machine.py``).
    def computes(self, seq: Seq, start: int, end: int) -> None:
        """The step computes tokens ``[start, end)`` of ``seq`` into its slots."""

    def copied(self, pairs, to_host: bool = False, from_host: bool = False) -> None:
        """Whole-block copies (fork, swap-out to the host, swap-in from it) were ordered."""

    @rule()
    def reset_cache(self) -> None:
        reset = getattr(self.alloc, "reset_prefix_cache", None)
        if reset is not None:
            reset()
            assert self.alloc.stats().num_cached_blocks == 0

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        events = self.events.drain()
        replay(events, self.held_hashes)
        assert self.held_hashes == self.alloc.prefix_hashes()
        self.check_other_media(events)

    def check_other_media(self, events: list) -> None:
        """Subclasses with lower tiers check the events of their media here."""
        self.space.check_invariants()
        assert self.space.num_used_blocks == sum(len(h) for _, _, h in self.swapped.values())
        for sid, (seq, _, host) in self.swapped.items():
            assert self.space.blocks_of(sid) == host and not self.alloc.has_seq(seq)
        s = self.alloc.stats()
        assert s.num_empty_blocks + s.num_used_blocks + s.num_cached_blocks == s.num_total_blocks
        assert s.num_seqs == len(self.live)
        # Physical slots: a block shared by a prefix hit or a fork counts once.
        assert s.used_slots == len(set().union(*self.slots.values()))
        assert s.allocated_slots == s.num_used_blocks * self.alloc.block_size
        # No two live sequences may write the same slot: each one's writable region (its
        # partial tail block) is its own.
        bs = self.alloc.block_size
        tails = {}
        for sid, seq in self.live.items():
            n = self.alloc.num_tokens(seq)
            if n % bs:
                tail = self.alloc.block_table(seq)[-1]
                assert tail not in tails, f"seqs {sid} and {tails[tail]} share a writable block"
                tails[tail] = sid
        if isinstance(self.alloc, ReservedAllocator):
            assert s.reserved_unused_slots == s.allocated_slots - s.used_slots

    def teardown(self) -> None:
        for seq in list(self.live.values()):
            self.alloc.free(seq)
        for sid in list(self.swapped):
            self.space.release(sid)
        self.alloc.check_invariants()
        self.space.check_invariants()
        assert self.space.num_free_blocks == self.space.num_blocks, "host blocks leaked"
        assert self.alloc.stats().num_used_blocks == 0, "blocks leaked after freeing everything"


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine_for(kind: str):
    machine = type(f"Machine_{kind}", (AllocatorMachine,), {"kind": kind})
    machine.TestCase.settings = SETTINGS
    return machine.TestCase


TestPaged16 = _machine_for("paged16")
TestPaged1 = _machine_for("paged1")
TestPagedNoCache = _machine_for("paged16-nocache")
TestRadix1 = _machine_for("radix1")
TestRadix16 = _machine_for("radix16")
TestReserved = _machine_for("reserved")
