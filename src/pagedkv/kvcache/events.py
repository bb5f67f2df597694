"""KV events: what an allocator tells the outside world about the blocks its prefix cache holds.

A router that sends requests sharing a prefix to the replica holding it needs to know, per
replica, which chained block hashes are cached there. Allocators report every change to that
set, and nothing else:

* ``BlockStored``: full blocks entered the prefix cache (a run of chained hashes, in order,
  with the hash of the block before the first one; ``None`` when the run starts at block 0);
* ``BlockRemoved``: blocks left it (evicted, or dropped by a cache reset);
* ``AllBlocksCleared``: the replica holds nothing (sent first by a fresh engine, so that a
  reader replaying a stream starts from an empty set).

Replaying a replica's events in order into a set of hashes gives exactly the hashes its prefix
cache holds (tests check this after every operation). A hash that two in-use blocks hold is one
hash: it is stored when the first enters the index and removed when the last leaves.

Names follow vLLM's event schema (``BlockStored.block_hashes``, ``parent_block_hash``,
``block_size``, ``lora_id``, ``medium``; ``KVEventBatch.ts``, ``events``). Differences: hashes
are bytes (hex in JSON), ``token_ids`` are not sent (a router hashes the request itself, and
a 10k-token prompt would make every event 50 KB); ``num_tokens`` is given instead, and
``medium`` names one of pagedkv's tiers (``device``, ``host``).

**Partial matches.** An allocator whose prefix match unit is below the block size
(``partial.py``) can reuse a block whose first tokens match, which no hash says: its
``BlockStored`` events carry the blocks' ``token_ids`` (vLLM's field), so a router can keep
the same per-parent token index (``routing/index.py``) and score a request's partial block. A
partly filled tail kept for reuse is one such event whose ``token_ids`` are shorter than a
block. Without partial reuse no event carries them (the stream is the same as before).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kvcache.event_wire import (
    MAX_BLOCK_SIZE,
    MAX_ENTRY_BYTES,
    MAX_HASH_BYTES,
    MAX_HASHES_PER_ENTRY,
    MAX_NAME_CHARS,
    MAX_TS_S,
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    TOO_MANY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from pagedkv.kvcache.hashing import BlockHash

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_ENTRY_BYTES",
    "MAX_HASHES_PER_ENTRY",
    "MAX_HASH_BYTES",
    "MAX_NAME_CHARS",
    "MAX_TS_S",
    "MEDIUM_DEVICE",
    "MEDIUM_HOST",
    "TOO_MANY",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventLog",
    "replay",
]


class KVEventLog:
    """Collects one allocator's events (and its lower tiers') between drains; the engine or the
    simulator drains it once per step. Consecutive removals from one medium are merged into one
    ``BlockRemoved``. Not thread-safe: the allocator and the drainer are the engine's thread."""

    def __init__(self, medium: str = MEDIUM_DEVICE) -> None:
        self.medium = medium  # the default medium of ``stored`` and ``removed``
        self._events: list[KVEvent] = []
        self._removed: list[BlockHash] = []
        self._removed_medium = medium
        self.num_stored_blocks = 0
        self.num_removed_blocks = 0

    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        block_size: int,
        lora_id: str | None = None,
        medium: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        if not block_hashes:
            return
        self._flush_removed()
        tokens = None if token_ids is None else tuple(token_ids)
        medium = medium or self.medium
        run = tuple(block_hashes)
        self._events.append(
            BlockStored(run, parent_block_hash, block_size, lora_id, medium, tokens)
        )
        self.num_stored_blocks += len(block_hashes)

    def stored_new(
        self,
        block_hashes: Sequence[BlockHash],
        is_new: Sequence[bool],
        parent_block_hash: BlockHash | None,
        block_size: int,
        lora_id: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Of a chain of blocks (``parent_block_hash`` before the first), report the ones
        ``is_new`` marks, as runs of consecutive blocks, each with its own parent (and its
        blocks' slice of ``token_ids``, the chain's tokens, when given)."""
        bs = block_size
        runs: list[tuple[int, int]] = []  # (first block, past the last) of each new run
        for i, new in enumerate(is_new):
            if new and runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            elif new:
                runs.append((i, i + 1))
        for first, end in runs:
            parent = block_hashes[first - 1] if first else parent_block_hash
            tokens = None if token_ids is None else token_ids[first * bs : end * bs]
            self.stored(block_hashes[first:end], parent, bs, lora_id, token_ids=tokens)

    def removed(self, block_hash: BlockHash, medium: str | None = None) -> None:
        medium = medium or self.medium
        if medium != self._removed_medium:
            self._flush_removed()
            self._removed_medium = medium
        self._removed.append(block_hash)
        self.num_removed_blocks += 1

    def cleared(self) -> None:
        self._removed.clear()
        self._events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed), self._removed_medium))
            self._removed = []

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first; the log is empty afterwards."""
        self._flush_removed()
        out, self._events = self._events, []
        return out


def replay(events: Sequence[KVEvent], held: set[BlockHash], medium: str = MEDIUM_DEVICE) -> None:
    """Apply ``events`` to ``held``, the hashes one replica holds in ``medium``."""
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            held.clear()
        elif ev.medium != medium:
            continue
        elif isinstance(ev, BlockStored):
            held.update(ev.block_hashes)
        else:
            held.difference_update(ev.block_hashes)
