"""The host swap space and the swap-out / swap-in moves, run against every allocator."""

from __future__ import annotations

import pytest

from pagedkv.kvcache.tiers.swap_space import SwapSpace, swap_in, swap_out

from .conftest import Seq, admit


def test_swap_space_hands_out_each_host_block_once() -> None:
    space = SwapSpace(5)
    assert space.take(1, 3) == [0, 1, 2]
    assert space.take(2, 3) is None  # all or nothing
    assert space.num_free_blocks == 2 and not space.holds(2)
    assert space.take(2, 2) == [3, 4]
    space.check_invariants()
    with pytest.raises(ValueError, match="already swapped out"):
        space.take(1, 1)
    assert space.release(1) == [0, 1, 2]
    with pytest.raises(ValueError, match="holds no blocks"):
        space.release(1)
    assert sorted(space.take(3, 3)) == [0, 1, 2]
    space.check_invariants()
    space._free.append(4)  # a block both free and owned: the invariant check must see it
    with pytest.raises(AssertionError, match="doubly owned|counted twice"):
        space.check_invariants()
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        SwapSpace(0)


def _write(memory: dict[int, object], alloc, seq: Seq, start: int, end: int) -> None:
    """The forward pass: slot -> (seq, position) for tokens [start, end)."""
    for pos, slot in enumerate(alloc.slot_mapping(seq, start, end), start):
        memory[slot] = tuple(seq.token_ids[: pos + 1])


def _copy(src_mem, dst_mem, pairs, bs) -> None:
    for src, dst in pairs:
        for off in range(bs):
            if src * bs + off in src_mem:
                dst_mem[dst * bs + off] = src_mem[src * bs + off]


def test_swap_out_and_in_moves_the_right_kv_to_the_right_slots(make_alloc) -> None:
    alloc = make_alloc(1024)
    bs = alloc.block_size
    space = SwapSpace(max(2, 300 // bs))
    device: dict[int, object] = {}
    host_mem: dict[int, object] = {}
    a = Seq(1, list(range(100, 137)))  # 37 tokens: a partial tail block (unless B divides)
    admit(alloc, a)
    _write(device, alloc, a, 0, 37)
    pairs = swap_out(alloc, space, a, 37)
    assert pairs is not None and not alloc.has_seq(a)
    _copy(device, host_mem, [(d, h) for d, h in pairs], bs)
    alloc.check_invariants()
    space.check_invariants()
    # Someone else takes (and overwrites) device blocks meanwhile.
    b = Seq(2, list(range(900, 960)))
    admit(alloc, b)
    _write(device, alloc, b, 0, 60)
    a.token_ids.append(7)  # the token it sampled before it was preempted
    back = swap_in(alloc, space, a, 37, 1)
    assert back is not None
    start, num_new, copies = back
    assert (start, num_new) == (37, 1) and not space.holds(1)
    _copy(host_mem, device, [(h, d) for h, d in copies], bs)
    alloc.check_invariants()
    space.check_invariants()
    # Its 37 tokens of KV are back where its block table says, whatever the allocator.
    for pos, slot in enumerate(alloc.slot_mapping(a, 0, 37)):
        assert device[slot] == tuple(a.token_ids[: pos + 1]), f"position {pos}"
    alloc.free(a)
    alloc.free(b)
    assert alloc.stats().num_used_blocks == 0 and space.num_free_blocks == space.num_blocks


def test_swap_out_refused_by_a_full_swap_space_changes_nothing(make_alloc) -> None:
    alloc = make_alloc(1024)
    space = SwapSpace(1)
    a = Seq(1, list(range(200)))  # more than one block everywhere but reserved
    admit(alloc, a)
    table = list(alloc.block_table(a))
    if len(table) == 1:  # reserved: one region; fill the swap space first
        space.take(99, 1)
    assert swap_out(alloc, space, a, 200) is None
    assert list(alloc.block_table(a)) == table and not space.holds(1)
    with pytest.raises(ValueError, match="holds 200 tokens, not 201"):
        swap_out(alloc, space, a, 201)
