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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.kvcache.hashing import BlockHash

MEDIUM_DEVICE = "device"
MEDIUM_HOST = "host"


@dataclass(frozen=True)
class BlockStored:
    """Full blocks that entered the prefix cache: ``block_hashes[i]``'s parent is
    ``block_hashes[i - 1]``, the first one's is ``parent_block_hash``."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    lora_id: str | None = None
    medium: str = MEDIUM_DEVICE

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left the prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """The replica's prefix cache (every medium) holds nothing now."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _event_to_dict(ev: KVEvent) -> dict:
    if isinstance(ev, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [h.hex() for h in ev.block_hashes],
            "parent_block_hash": ev.parent_block_hash.hex() if ev.parent_block_hash else None,
            "block_size": ev.block_size,
            "num_tokens": ev.num_tokens,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
        }
    if isinstance(ev, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h.hex() for h in ev.block_hashes],
            "medium": ev.medium,
        }
    return {"type": "AllBlocksCleared"}


def _event_from_dict(d: dict) -> KVEvent:
    kind = d["type"]
    if kind == "BlockStored":
        parent = d["parent_block_hash"]
        block_size = int(d["block_size"])
        if block_size < 1:
            raise ValueError(f"block_size {block_size}")
        lora = d.get("lora_id")
        return BlockStored(
            tuple(bytes.fromhex(h) for h in d["block_hashes"]),
            bytes.fromhex(parent) if parent is not None else None,
            block_size,
            str(lora) if lora is not None else None,
            str(d.get("medium", MEDIUM_DEVICE)),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            tuple(bytes.fromhex(h) for h in d["block_hashes"]),
            str(d.get("medium", MEDIUM_DEVICE)),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, in order. ``ts``: seconds (wall clock in the engine,
    simulated time in the simulator)."""

    ts: float
    events: tuple[KVEvent, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"ts": self.ts, "events": [_event_to_dict(e) for e in self.events]},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> KVEventBatch:
        """ValueError on anything that is not a batch this version wrote."""
        try:
            data = json.loads(text)
            return cls(float(data["ts"]), tuple(_event_from_dict(e) for e in data["events"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a pagedkv KV event batch: {exc!r}") from None


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
    ) -> None:
        if not block_hashes:
            return
        self._flush_removed()
        self._events.append(
            BlockStored(
                tuple(block_hashes), parent_block_hash, block_size, lora_id, medium or self.medium
            )
        )
        self.num_stored_blocks += len(block_hashes)

    def stored_new(
        self,
        block_hashes: Sequence[BlockHash],
        is_new: Sequence[bool],
        parent_block_hash: BlockHash | None,
        block_size: int,
        lora_id: str | None = None,
    ) -> None:
        """Of a chain of blocks (``parent_block_hash`` before the first), report the ones
        ``is_new`` marks, as runs of consecutive blocks, each with its own parent."""
        run: list[BlockHash] = []
        run_parent = prev = parent_block_hash
        for h, new in zip(block_hashes, is_new, strict=True):
            if new:
                if not run:
                    run_parent = prev
                run.append(h)
            elif run:
                self.stored(run, run_parent, block_size, lora_id)
                run = []
            prev = h
        self.stored(run, run_parent, block_size, lora_id)

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
