"""KV events against hand-computed cases: what each allocator reports, in which order, and
that the hashes it reports are the ones a router computes from the tokens alone."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pagedkv.kvcache import PagedAllocator, RadixAllocator, ReservedAllocator
from pagedkv.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    replay,
)
from pagedkv.routing import prompt_block_hashes

from .conftest import Seq, admit


def _sha(parent: bytes, tokens: list[int]) -> bytes:
    """The chain written out from the hashing module's documented recipe, not its code."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


ROOT = hashlib.sha256(b"pagedkv-v1\x00lora=None\x00salt=None").digest()


def test_paged_reports_full_blocks_with_their_parent_and_nothing_for_the_tail():
    alloc = PagedAllocator(8, 4)
    log = KVEventLog()
    alloc.enable_events(log)
    assert log.drain() == [AllBlocksCleared()]
    tokens = list(range(10, 20))  # 10 tokens at B=4: two full blocks and a tail of 2
    admit(alloc, Seq(1, tokens))
    h0 = _sha(ROOT, tokens[0:4])
    h1 = _sha(h0, tokens[4:8])
    (ev,) = log.drain()
    assert ev == BlockStored((h0, h1), None, 4)
    assert ev.num_tokens == 8
    # Two more tokens fill block 2: one event, parent h1.
    seq = Seq(1, tokens + [20, 21])
    assert alloc.allocate(seq, 2)
    assert log.drain() == [BlockStored((_sha(h1, [18, 19, 20, 21]),), h1, 4)]


def test_paged_hit_reports_nothing_and_eviction_reports_removed():
    alloc = PagedAllocator(4, 4)  # 3 usable blocks
    log = KVEventLog()
    alloc.enable_events(log)
    a = Seq(1, list(range(9)))  # blocks 0, 1 full
    admit(alloc, a)
    alloc.free(a)
    log.drain()
    b = Seq(2, list(range(9)))  # the same prompt: a hit on both blocks
    assert admit(alloc, b) == 8
    assert log.drain() == []  # the hashes did not change
    alloc.free(b)
    c = Seq(3, list(range(100, 109)))  # needs 3 blocks: both cached ones are evicted
    admit(alloc, c)
    events = log.drain()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        [_sha(ROOT, list(range(4))), _sha(_sha(ROOT, list(range(4))), list(range(4, 8)))]
    )
    # Removals come before the new blocks are stored (replay order matters).
    assert isinstance(events[0], BlockRemoved) and isinstance(events[-1], BlockStored)


def test_reset_reports_the_cached_blocks_removed_and_keeps_the_ones_in_use():
    alloc = PagedAllocator(16, 4)
    log = KVEventLog()
    alloc.enable_events(log)
    held: set[bytes] = set()
    a, b = Seq(1, list(range(9))), Seq(2, list(range(50, 59)))
    admit(alloc, a)
    admit(alloc, b)
    alloc.free(a)
    alloc.reset_prefix_cache()
    replay(log.drain(), held)
    assert held == alloc.prefix_hashes() == set(prompt_block_hashes(b.token_ids, 4))


def test_enable_events_late_reports_a_snapshot():
    alloc = PagedAllocator(16, 4)
    admit(alloc, Seq(1, list(range(13))))
    log = KVEventLog()
    alloc.enable_events(log)
    held = {b"stale"}
    replay(log.drain(), held)
    assert held == alloc.prefix_hashes() and len(held) == 3


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_radix_pages_get_the_hashes_a_paged_allocator_and_the_router_give(block_size):
    tokens = [7, 3, 9, 1] * 12 + [5]
    paged, radix = PagedAllocator(64, block_size), RadixAllocator(64 * block_size, block_size)
    logs = KVEventLog(), KVEventLog()
    paged.enable_events(logs[0])
    radix.enable_events(logs[1])
    for alloc in (paged, radix):
        admit(alloc, Seq(1, tokens))
        alloc.free(Seq(1, tokens))  # radix enters the tree at the end of the prompt / at free
    got = []
    for log in logs:
        held: set[bytes] = set()
        replay(log.drain(), held)
        got.append(held)
    full = len(tokens) // block_size
    router = prompt_block_hashes(tokens + [0], block_size)  # + a token: every full block
    assert got[0] == got[1] == set(router[:full])


def test_radix_refuses_late_enable_and_reserved_reports_nothing_cached():
    radix = RadixAllocator(64, 4)
    admit(radix, Seq(1, list(range(9))))
    radix.free(Seq(1, list(range(9))))
    with pytest.raises(ValueError, match="before the first admission"):
        radix.enable_events(KVEventLog())
    reserved, log = ReservedAllocator(512, 64), KVEventLog()
    reserved.enable_events(log)
    admit(reserved, Seq(1, list(range(40))))
    assert log.drain() == [AllBlocksCleared()] and reserved.prefix_hashes() == set()


def test_log_merges_consecutive_removals_and_keeps_order():
    log = KVEventLog()
    log.removed(b"a")
    log.removed(b"b")
    log.stored([b"c"], b"p", 16)
    log.removed(b"c")
    assert log.drain() == [
        BlockRemoved((b"a", b"b")),
        BlockStored((b"c",), b"p", 16),
        BlockRemoved((b"c",)),
    ]
    assert log.drain() == []
    assert (log.num_stored_blocks, log.num_removed_blocks) == (1, 3)


def test_batch_json_round_trip_and_malformed_input():
    batch = KVEventBatch(
        12.5,
        (
            AllBlocksCleared(),
            BlockStored((b"\x01" * 32, b"\x02" * 32), None, 16, "lora-a", "host"),
            BlockRemoved((b"\x01" * 32,)),
        ),
    )
    text = batch.to_json()
    assert KVEventBatch.from_json(text) == batch
    assert '"parent_block_hash":null' in text and '"num_tokens":32' in text
    for bad in ("", "{}", '{"ts": 1, "events": [{"type": "Nope"}]}',
                '{"ts": 1, "events": [{"type": "BlockRemoved", "block_hashes": ["zz"]}]}',
                '{"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [],'
                ' "parent_block_hash": null, "block_size": 0}]}'):  # fmt: skip
        with pytest.raises(ValueError, match="not a pagedkv KV event batch"):
            KVEventBatch.from_json(bad)
