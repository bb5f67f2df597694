"""What an engine replica tells Serve's request router, through Serve's
``record_routing_stats`` (the controller polls each replica every
``request_routing_stats_period_s`` and broadcasts a changed dict to every router).

A replica sends its load and a snapshot of the block hashes its prefix cache holds (device and
host tier together: the same hashes its KV events would replay to), with an ``epoch`` that
changes only when that set changes, so a router rebuilds a replica's entries only then. The
snapshot is state, not a delta: a router that missed a broadcast (Serve coalesces them) is
right again at the next one. It is capped at ``max_blocks`` hashes (past the cap the replica
says ``truncated`` and a router sees part of its cache: fewer hits, never a wrong answer; a
pool that large publishes KV events to Redis instead, ``--kv-events``).

Imports neither ray nor torch: the replica and the router (and the tests) share it. A router
reads a dict from another process as untrusted input: ``parse_stats`` bounds and checks every
field and raises ``UntrustedInput`` for anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv import untrusted as u
from pagedkv.kvcache.events import MAX_HASH_BYTES, AllBlocksCleared, BlockStored, KVEvent
from pagedkv.kvcache.hashing import BlockHash

SCHEMA = "pagedkv-routing-stats/1"
# Hashes one snapshot carries: 4,096 sha256 hashes are 128 KiB per replica per change, the
# most a controller broadcast should hold (a 512 MiB CPU pool of the embedded model is ~700
# blocks of 16 tokens).
DEFAULT_MAX_BLOCKS = 4096
MAX_BLOCKS_LIMIT = 1 << 16  # what a router accepts whatever a replica was told
MAX_ID_CHARS = 256
MAX_REQUESTS = 1 << 30


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's routing stats. ``num_requests``: running + queued there when it was
    polled. ``epoch``: changes whenever ``block_hashes`` does (and with a new
    ``instance_id``: a restarted engine)."""

    instance_id: str
    num_requests: int
    epoch: int
    block_size: int
    block_hashes: tuple[BlockHash, ...]
    truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "instance_id": self.instance_id,
            "num_requests": self.num_requests,
            "epoch": self.epoch,
            "block_size": self.block_size,
            "block_hashes": list(self.block_hashes),
            "truncated": self.truncated,
        }

    def snapshot_events(self) -> tuple[KVEvent, ...]:
        """What replaying this replica's KV events would give, as events for a
        ``PrefixIndex``: everything cleared, then every hash held (parents unknown)."""
        stored = (
            BlockStored(self.block_hashes, None, self.block_size) if self.block_hashes else None
        )
        return (AllBlocksCleared(),) if stored is None else (AllBlocksCleared(), stored)


class StatsMaker:
    """The replica side: the stats for each poll, with ``epoch`` bumped only when the set of
    hashes changed since the last poll."""

    def __init__(self, instance_id: str, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if not 0 <= max_blocks <= MAX_BLOCKS_LIMIT:
            raise ValueError(f"max_blocks must be in [0, {MAX_BLOCKS_LIMIT}], got {max_blocks}")
        self.instance_id, self.block_size, self.max_blocks = instance_id, block_size, max_blocks
        self._epoch = 0
        self._last: frozenset[BlockHash] = frozenset()

    def make(self, num_requests: int, held: Iterable[BlockHash]) -> ReplicaStats:
        hashes = frozenset(held)
        if hashes != self._last:
            self._epoch += 1
            self._last = hashes
        ordered = sorted(hashes)  # one order for one set: an unchanged set is an equal dict
        return ReplicaStats(
            self.instance_id,
            num_requests,
            self._epoch,
            self.block_size,
            tuple(ordered[: self.max_blocks]),
            truncated=len(ordered) > self.max_blocks,
        )


def parse_stats(data: Any) -> ReplicaStats | None:
    """The stats a replica reported; None for an empty dict (a replica not polled yet);
    ``UntrustedInput`` naming the field for anything that is not such stats."""
    if isinstance(data, Mapping) and not data:
        return None
    d = u.as_object(dict(data) if isinstance(data, Mapping) else data, "routing stats")
    if d.get("schema") != SCHEMA:
        raise u.UntrustedInput(f"routing stats of another schema: {str(d.get('schema'))[:80]}")
    raw = u.get_list(d, "block_hashes", max_len=MAX_BLOCKS_LIMIT)
    for i, h in enumerate(raw):
        if not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
            raise u.UntrustedInput(f"block_hashes[{i}] is not a block hash")
    return ReplicaStats(
        instance_id=u.get_str(d, "instance_id", max_len=MAX_ID_CHARS),
        num_requests=u.get_int(d, "num_requests", lo=0, hi=MAX_REQUESTS),
        epoch=u.get_int(d, "epoch", lo=0, hi=1 << 62),
        block_size=u.get_int(d, "block_size", lo=1, hi=1 << 20),
        block_hashes=tuple(raw),
        truncated=u.get_bool(d, "truncated"),
    )
