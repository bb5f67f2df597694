"""The KV events' wire format: the event types, their bounds and their JSON, checked as the
untrusted input they are when read back (``KVEventBatch.from_json``). What the events mean, and
who reports them, is ``events.py``'s docstring; this module only says how they travel.
"""

from __future__ import annotations

import json
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
    # The blocks' tokens, ``block_size`` each (the last one may be shorter: a kept partial
    # tail); None unless the allocator reuses partial blocks (module docstring).
    token_ids: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
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
            **({} if ev.token_ids is None else {"token_ids": list(ev.token_ids)}),
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
            raise UntrustedInput(
                f"{at}[{i}] must be the hex of 1 to {MAX_HASH_BYTES} bytes, got {shown}"
            )
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
    block_size = get_int(d, "block_size", lo=1, hi=MAX_BLOCK_SIZE, at=at)
    return BlockStored(
        hashes,
        None if parent is None else _hashes([parent], f"{at}.parent_block_hash")[0],
        block_size,
        get_optional_str(d, "lora_id", max_len=MAX_NAME_CHARS, at=at),
        medium,
        _token_ids(d, len(hashes), block_size, at) if "token_ids" in d else None,
    )


def _token_ids(d: dict, num_blocks: int, block_size: int, at: str) -> tuple[int, ...]:
    """A stored run's tokens: ``block_size`` per block, the last block's at least 1 (a partial
    tail), each a token id of 32 bits."""
    raw = get_list(d, "token_ids", max_len=num_blocks * block_size, at=at)
    if len(raw) <= (num_blocks - 1) * block_size:
        raise UntrustedInput(f"{at}.token_ids: {len(raw)} tokens for {num_blocks} blocks")
    for i, t in enumerate(raw):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise UntrustedInput(f"{at}.token_ids[{i}] must be a token id (0 to 2**32 - 1)")
    return tuple(raw)


def _batch_from_json(text: str | bytes) -> tuple[float, tuple[KVEvent, ...]]:
    data = as_object(parse_json(text, max_bytes=MAX_ENTRY_BYTES, what="the entry"), "the entry")
    ts = get_float(data, "ts", lo=0.0, hi=MAX_TS_S)
    raw = [
        as_object(e, f"events[{i}]")
        for i, e in enumerate(get_list(data, "events", max_len=MAX_HASHES_PER_ENTRY, kind=TOO_MANY))
    ]
    # Every event counts one hash at least, so the events are bounded too.
    num_hashes = 0
    for i, e in enumerate(raw):
        if e.get("type") in ("BlockStored", "BlockRemoved"):
            num_hashes += max(
                len(
                    get_list(
                        e,
                        "block_hashes",
                        max_len=MAX_HASHES_PER_ENTRY,
                        at=f"events[{i}]",
                        kind=TOO_MANY,
                    )
                ),
                1,
            )
        else:
            num_hashes += 1
        if num_hashes > MAX_HASHES_PER_ENTRY:
            raise UntrustedInput(
                f"the entry holds over {MAX_HASHES_PER_ENTRY} block hashes", TOO_MANY
            )
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
