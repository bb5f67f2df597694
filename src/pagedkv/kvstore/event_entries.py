"""How the publisher turns one ``KVEventBatch`` into stream entries that every reader accepts.

A reader refuses an entry over ``MAX_HASHES_PER_ENTRY`` block hashes or ``MAX_ENTRY_BYTES`` of
JSON (``kvcache/event_wire.py`` owns both bounds), so a batch past them (a snapshot of a large
cache, a 300k-token prompt's run) is cut into consecutive parts, each one entry. Replaying the
parts in order is replaying the batch: events keep their order, and a run of stored blocks cut
in two keeps its chain (the second part's parent is the first part's last hash).
"""

from __future__ import annotations

from dataclasses import replace

from pagedkv.kvcache.events import (
    MAX_ENTRY_BYTES,
    MAX_HASHES_PER_ENTRY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)


def entry_texts(
    batch: KVEventBatch,
    max_hashes: int = MAX_HASHES_PER_ENTRY,
    max_bytes: int = MAX_ENTRY_BYTES,
) -> list[str]:
    """The JSON of each entry ``batch`` is sent as (one for any batch within the bounds)."""
    return [text for part in split_batch(batch, max_hashes) for text in _fit(part, max_bytes)]


def split_batch(batch: KVEventBatch, max_hashes: int) -> list[KVEventBatch]:
    """``batch`` as consecutive parts of at most ``max_hashes`` hashes each (an event counts
    one at least, so the events of a part are bounded too); the parts keep ``batch.ts``."""
    parts: list[list[KVEvent]] = [[]]
    weight = 0
    for event in batch.events:
        for piece in _cut(event, max_hashes):
            w = _weight(piece)
            if parts[-1] and weight + w > max_hashes:
                parts.append([])
                weight = 0
            parts[-1].append(piece)
            weight += w
    return [KVEventBatch(batch.ts, tuple(p)) for p in parts]


def _weight(event: KVEvent) -> int:
    return 1 if isinstance(event, AllBlocksCleared) else max(len(event.block_hashes), 1)


def _cut(event: KVEvent, max_hashes: int) -> list[KVEvent]:
    """``event`` as events of at most ``max_hashes`` hashes, in order."""
    if isinstance(event, AllBlocksCleared) or len(event.block_hashes) <= max_hashes:
        return [event]
    hashes = event.block_hashes
    starts = range(0, len(hashes), max_hashes)
    if isinstance(event, BlockRemoved):
        return [BlockRemoved(hashes[i : i + max_hashes], event.medium) for i in starts]
    assert isinstance(event, BlockStored)
    tokens, bs = event.token_ids, event.block_size  # with partial reuse: block_size per block
    return [
        replace(
            event,
            block_hashes=hashes[i : i + max_hashes],
            parent_block_hash=hashes[i - 1] if i else event.parent_block_hash,
            token_ids=None if tokens is None else tokens[i * bs : (i + max_hashes) * bs],
        )
        for i in starts
    ]


def _fit(batch: KVEventBatch, max_bytes: int) -> list[str]:
    """``batch``'s JSON, halved until each part is within ``max_bytes`` (JSON of ours is
    ASCII: characters are bytes). A lone one-hash event over the bound cannot be cut: it is
    sent as it is (the bounds leave room for any name a reader accepts)."""
    text = batch.to_json()
    if len(text) <= max_bytes:
        return [text]
    events = batch.events
    if len(events) == 1:
        (event,) = events
        n = 0 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)
        if n <= 1:
            return [text]
        events = tuple(_cut(event, (n + 1) // 2))
    mid = len(events) // 2
    halves = (KVEventBatch(batch.ts, events[:mid]), KVEventBatch(batch.ts, events[mid:]))
    return [t for half in halves for t in _fit(half, max_bytes)]
