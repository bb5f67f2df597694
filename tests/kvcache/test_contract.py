"""The allocator contract, run against every allocator (paged, radix, reserved)."""

from __future__ import annotations

import pytest

from pagedkv.kvcache import KVAllocator, ReservedAllocator
from pagedkv.kvcache.events import KVEventLog, replay

from .conftest import Seq, admit


def occupied_slots(alloc: KVAllocator, seqs: list[Seq]) -> dict[int, list[int]]:
    return {s.seq_id: alloc.slot_mapping(s, 0, alloc.num_tokens(s)) for s in seqs}


def test_satisfies_protocol(make_alloc):
    assert isinstance(make_alloc(4096), KVAllocator)


def test_events_replay_to_the_prefix_hashes_and_no_tier_orders_without_tiers(make_alloc):
    """What the engine, the simulator and the scheduler call besides the slots, on every
    allocator: the event log replays to ``prefix_hashes()``, and without lower tiers a step
    orders no tier copies."""
    alloc = make_alloc(4096)
    log = KVEventLog()
    alloc.enable_events(log)
    held: set[bytes] = {b"stale"}  # AllBlocksCleared must come first
    a, b = Seq(1, list(range(40))), Seq(2, list(range(30)) + [9] * 10)
    admit(alloc, a)
    admit(alloc, b)
    alloc.free(a)
    replay(log.drain(), held)
    assert held == alloc.prefix_hashes()
    assert alloc.drain_tier_orders().is_empty


def test_slots_follow_the_block_table_formula(make_alloc):
    alloc = make_alloc(4096)
    seqs = [Seq(i, [i * 1000 + t for t in range(37 + 20 * i)]) for i in range(3)]
    for s in seqs:
        admit(alloc, s)
        alloc.check_invariants()
    bs = alloc.block_size
    for s in seqs:
        table = alloc.block_table(s)
        slots = alloc.slot_mapping(s, 0, len(s.token_ids))
        assert slots == [table[i // bs] * bs + i % bs for i in range(len(s.token_ids))]
        assert alloc.slot_mapping(s, 5, 9) == slots[5:9]


def test_live_sequences_never_share_a_writable_slot(make_alloc):
    alloc = make_alloc(4096)
    seqs = [Seq(i, [7] * 30 + [i] * (10 + i)) for i in range(4)]  # common prefix of 30
    for s in seqs:
        admit(alloc, s)
    for _ in range(20):  # decode: every sequence grows by one token a step
        for s in seqs:
            s.token_ids.append(len(s.token_ids) + 100 * s.seq_id)
            assert alloc.allocate(s, 1)
        alloc.check_invariants()
    owned = occupied_slots(alloc, seqs)
    # The slots each sequence writes (everything past the shared prefix) are disjoint.
    writes = [set(v[30:]) for v in owned.values()]
    for i in range(len(writes)):
        for j in range(i + 1, len(writes)):
            assert not writes[i] & writes[j], f"seqs {i} and {j} write the same slot"


def test_allocation_is_all_or_nothing(make_alloc):
    alloc = make_alloc(512)
    big = Seq(1, list(range(10_000)))
    before = alloc.stats()
    assert alloc.match_prefix(big) == 0
    assert not alloc.allocate(big, len(big.token_ids))
    alloc.check_invariants()
    after = alloc.stats()
    assert (after.num_empty_blocks, after.num_used_blocks, after.num_seqs) == (
        before.num_empty_blocks,
        before.num_used_blocks,
        0,
    )
    assert not alloc.has_seq(big)


def test_growth_refused_when_full_changes_nothing(make_alloc):
    alloc = make_alloc(512)
    seqs, i = [], 0
    while True:  # fill the pool with 40-token sequences until one is refused
        s = Seq(i, [i * 97 + t for t in range(40)])
        if not alloc.allocate(s, 40):
            break
        seqs.append(s)
        i += 1
    assert seqs
    victim = seqs[0]
    room = alloc.num_allocatable_blocks * alloc.block_size + 1000
    if isinstance(alloc, ReservedAllocator):
        room = alloc.max_model_len  # past its region
    n_before = alloc.num_tokens(victim)
    table_before = list(alloc.block_table(victim))
    victim.token_ids.extend(range(room))
    assert not alloc.allocate(victim, room)
    assert alloc.num_tokens(victim) == n_before and list(alloc.block_table(victim)) == table_before
    alloc.check_invariants()


def test_free_returns_everything(make_alloc):
    alloc = make_alloc(4096)
    seqs = [Seq(i, list(range(i, i + 50))) for i in range(5)]
    for s in seqs:
        admit(alloc, s)
    for s in seqs:
        alloc.free(s)
        alloc.check_invariants()
    st = alloc.stats()
    assert st.num_used_blocks == 0 and st.num_seqs == 0 and st.used_slots == 0
    assert st.num_empty_blocks + st.num_cached_blocks == st.num_total_blocks


def test_fork_copies_the_tail_and_leaves_the_parent_untouched(make_alloc):
    alloc = make_alloc(4096)
    parent = Seq(1, list(range(1000, 1000 + 40)))
    admit(alloc, parent)
    parent_table = list(alloc.block_table(parent))
    parent_slots = alloc.slot_mapping(parent, 0, 40)
    child = Seq(2, list(parent.token_ids))
    copies = alloc.fork(parent, child)
    alloc.check_invariants()
    assert copies is not None
    bs = alloc.block_size
    num_full = 40 // bs
    child_table = list(alloc.block_table(child))
    if isinstance(alloc, ReservedAllocator):
        assert copies == [(parent_table[0], child_table[0])] and child_table != parent_table
    else:
        assert child_table[:num_full] == parent_table[:num_full]  # shared full blocks
        if 40 % bs:
            assert copies == [(parent_table[-1], child_table[-1])]
            assert child_table[-1] != parent_table[-1]
        else:
            assert copies == []
    # The child writes its next token somewhere the parent never reads.
    child.token_ids.append(5)
    parent.token_ids.append(6)
    assert alloc.allocate(child, 1) and alloc.allocate(parent, 1)
    assert alloc.slot_mapping(parent, 0, 40) == parent_slots
    assert alloc.slot_mapping(child, 40, 41)[0] not in alloc.slot_mapping(parent, 0, 41)
    alloc.check_invariants()
    alloc.free(parent)
    alloc.free(child)
    alloc.check_invariants()
    assert alloc.stats().num_used_blocks == 0


def test_block_table_export_is_padded_int32(make_alloc):
    alloc = make_alloc(4096)
    a, b = Seq(1, list(range(70))), Seq(2, list(range(500, 503)))
    admit(alloc, a)
    admit(alloc, b)
    flat, width = alloc.block_tables([a, b])
    assert flat.typecode == "i" and flat.itemsize == 4
    assert width == max(len(alloc.block_table(a)), len(alloc.block_table(b)))
    rows = [list(flat[i * width : (i + 1) * width]) for i in range(2)]
    for s, row in zip((a, b), rows, strict=True):
        n = len(alloc.block_table(s))
        assert row[:n] == list(alloc.block_table(s)) and row[n:] == [0] * (width - n)
    wide, w_wide = alloc.block_tables([a, b], max_blocks=width + 3)
    assert w_wide == width + 3 and len(wide) == 2 * (width + 3)
    assert list(wide[width : width + 3]) == [0, 0, 0]
    with pytest.raises(ValueError):
        alloc.block_tables([a], max_blocks=0)


def test_stats_count_fragmentation_and_table(make_alloc):
    alloc = make_alloc(4096)
    lengths = [1, 17, 33, 64, 100]
    seqs = [Seq(i, [i * 1000 + t for t in range(n)]) for i, n in enumerate(lengths)]
    for s in seqs:
        admit(alloc, s)
    st = alloc.stats()
    bs = alloc.block_size
    blocks = [-(-n // bs) for n in lengths]
    assert st.used_slots == sum(lengths)
    assert st.allocated_slots == sum(blocks) * bs
    assert st.block_table_entries == sum(blocks)
    assert st.padded_table_bytes == 4 * len(lengths) * max(blocks)
    waste = sum(blocks) * bs - sum(lengths)
    if isinstance(alloc, ReservedAllocator):
        assert (st.internal_fragmentation_slots, st.reserved_unused_slots) == (0, waste)
    else:
        assert (st.internal_fragmentation_slots, st.reserved_unused_slots) == (waste, 0)
