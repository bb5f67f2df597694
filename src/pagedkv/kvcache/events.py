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
from pagedkv.untrusted import (
    UntrustedInput,
    as_object,
    as_str,
    field,
    get_float,
    get_int,
    get_list,
    get_optional_str,
    get_str,
    parse_json,
)

MEDIUM_DEVICE = "device"
MEDIUM_HOST = "host"

# One stream entry's bounds: a reader refuses past them (counted, skipped) and the publisher
# splits a batch into entries within them (``kvstore/event_entries.py``). An entry is one
# engine step's events, or a part of a snapshot.
MAX_HASHES_PER_ENTRY = 16_384  # block hashes over all its events (each event counts >= 1)
MAX_ENTRY_BYTES = 8 << 20  # its JSON: ~3.5 MB for a snapshot part of 16k sha256 hashes
MAX_HASH_BYTES = 64  # one block hash (sha256 and blake2b: 32, xxh3_128: 16)
MAX_NAME_CHARS = 256  # an event type, a medium, a lora_id
MAX_BLOCK_SIZE = 1 << 20  # tokens
MAX_TS_S = 1e15
TOO_MANY = "too_many_hashes"  # the ``UntrustedInput.kind`` of an entry over the hash cap


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


def _hashes(raw: list, at: str) -> tuple[BlockHash, ...]:
    """Hex strings -> hashes of 1 to ``MAX_HASH_BYTES`` bytes (``bytes.fromhex`` alone would
    take spaces between the bytes)."""
    out = []
    for i, text in enumerate(raw):
        try:
            h = bytes.fromhex(text) if len(text) <= 2 * MAX_HASH_BYTES else b""
        except (TypeError, ValueError):  # not a str, or not hex
            h = b""
        if not h or 2 * len(h) != len(text):
            shown = repr(text[:20]) if isinstance(text, str) else type(text).__name__
            raise UntrustedInput(f"{at}[{i}] must be the hex of 1 to {MAX_HASH_BYTES} bytes, "
                                 f"got {shown}")  # fmt: skip
        out.append(h)
    return tuple(out)


def _event_from_dict(d: dict, at: str) -> KVEvent:
    kind = get_str(d, "type", max_len=MAX_NAME_CHARS, at=at)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        raise UntrustedInput(f"{at}.type {kind[:40]!r} is not an event type of this version")
    hashes = _hashes(d["block_hashes"], f"{at}.block_hashes")  # a list: checked by the caller
    medium = d.get("medium", MEDIUM_DEVICE)
    medium = as_str(medium, f"{at}.medium", max_len=MAX_NAME_CHARS)
    if kind == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    parent = field(d, "parent_block_hash", at)
    return BlockStored(
        hashes,
        None if parent is None else _hashes([parent], f"{at}.parent_block_hash")[0],
        get_int(d, "block_size", lo=1, hi=MAX_BLOCK_SIZE, at=at),
        get_optional_str(d, "lora_id", max_len=MAX_NAME_CHARS, at=at),
        medium,
    )


def _batch_from_json(text: str | bytes) -> tuple[float, tuple[KVEvent, ...]]:
    data = as_object(parse_json(text, max_bytes=MAX_ENTRY_BYTES, what="the entry"), "the entry")
    ts = get_float(data, "ts", lo=0.0, hi=MAX_TS_S)
    raw = [as_object(e, f"events[{i}]") for i, e in
           enumerate(get_list(data, "events", max_len=MAX_HASHES_PER_ENTRY, kind=TOO_MANY))]  # fmt: skip
    # Every event counts one hash at least, so the events are bounded too.
    num_hashes = 0
    for i, e in enumerate(raw):
        if e.get("type") in ("BlockStored", "BlockRemoved"):
            num_hashes += max(len(get_list(e, "block_hashes", max_len=MAX_HASHES_PER_ENTRY,
                                           at=f"events[{i}]", kind=TOO_MANY)), 1)  # fmt: skip
        else:
            num_hashes += 1
        if num_hashes > MAX_HASHES_PER_ENTRY:
            raise UntrustedInput(f"the entry holds over {MAX_HASHES_PER_ENTRY} block hashes",
                                 TOO_MANY)  # fmt: skip
    return ts, tuple(_event_from_dict(e, f"events[{i}]") for i, e in enumerate(raw))


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
        """``UntrustedInput`` (a ``ValueError``; ``kind`` says what was wrong) on anything that
        is not a batch this version wrote within the caps above; never another exception."""
        try:
            return cls(*_batch_from_json(text))
        except UntrustedInput as exc:
            raise UntrustedInput(f"not a pagedkv KV event batch: {exc}", exc.kind) from None


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
