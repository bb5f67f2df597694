"""The publisher's side of the entry caps: a batch over ``MAX_HASHES_PER_ENTRY`` hashes or
``MAX_ENTRY_BYTES`` (a large snapshot, a very long prompt's run) is cut into entries a reader
takes, which replay to the same cache."""

from __future__ import annotations

from pagedkv.kvcache.events import (
    MAX_ENTRY_BYTES,
    MAX_HASHES_PER_ENTRY,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    replay,
)
from pagedkv.kvstore.event_entries import entry_texts, split_batch

GOOD = KVEventBatch(1.0, (AllBlocksCleared(), BlockStored((b"\xab" * 32,), None, 16)))


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _replayed(batches) -> tuple[set, set]:
    device, host = set(), set()
    for b in batches:
        replay(b.events, device)
        replay(b.events, host, MEDIUM_HOST)
    return device, host


def test_a_batch_over_the_caps_becomes_entries_within_them_that_replay_the_same():
    run = tuple(_h(i) for i in range(40_000))  # one prompt's run of 40k blocks
    snapshot = tuple(BlockStored((_h(i),), None, 16, "lora-" + "x" * 200, MEDIUM_HOST)
                     for i in range(50_000, 70_000))  # fmt: skip
    batch = KVEventBatch(3.0, (AllBlocksCleared(), BlockStored(run, _h(99), 16),
                               BlockRemoved(run[:20_000]), *snapshot))  # fmt: skip
    texts = entry_texts(batch)
    assert len(texts) > 3
    parts = [KVEventBatch.from_json(t) for t in texts]  # every part is one a reader takes
    assert all(len(t) <= MAX_ENTRY_BYTES for t in texts) and {p.ts for p in parts} == {3.0}
    assert _replayed(parts) == _replayed([batch])
    # the run cut in parts keeps its chain: each part's parent is the last hash before it
    runs = [e for p in parts for e in p.events if isinstance(e, BlockStored) and e.lora_id is None]
    assert [e.parent_block_hash for e in runs] == [_h(99)] + [r.block_hashes[-1] for r in runs[:-1]]
    assert sum(len(r.block_hashes) for r in runs) == len(run)


def test_split_keeps_a_small_batch_whole_and_counts_each_event_once_at_least():
    assert split_batch(GOOD, MAX_HASHES_PER_ENTRY) == [GOOD]
    assert entry_texts(GOOD) == [GOOD.to_json()]
    clears = KVEventBatch(0.0, (AllBlocksCleared(),) * 5)
    assert [len(p.events) for p in split_batch(clears, 2)] == [2, 2, 1]
    assert split_batch(KVEventBatch(0.0, ()), 4) == [KVEventBatch(0.0, ())]
