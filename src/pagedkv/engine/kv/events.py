"""KV events of a running engine (``--kv-events redis://HOST:PORT``), and the replica's
self-description that tells a router where to read them (``GET /pagedkv/info``).

``EngineKVEvents`` is the engine side: it turns the allocator's events on at start-up (before
the first admission) and, after every step (``after_step``, on the engine thread), drains the
log and hands one ``KVEventBatch`` to the ``KVEventPublisher`` (``kvstore/event_publisher.py``), which
sends it to the stream ``pagedkv:kv-events:<instance_id>`` off-thread. When the publisher asks
for a snapshot (after an outage, or periodically), the step's events are replaced by
``AllBlocksCleared`` + one ``BlockStored`` per hash ``allocator.prefix_hashes()`` holds now:
read on the engine thread, the only one that may touch the allocator.

The device pool's prefix cache is reported as medium ``device``; a host tier
(``--host-kv-memory``) as medium ``host`` (events are turned on after the tiers are attached, so
the allocator hands the log to the tier too). A shared store (``--kv-store``) is no replica's
cache and reports nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from pagedkv.engine.config import EngineConfig
from pagedkv.kvcache.events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventLog,
)
from pagedkv.kvcache.hashing import DEFAULT_HASH_ALGORITHM, BlockHash
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvstore.address import parse_store_url
from pagedkv.kvstore.event_publisher import KVEventPublisher

STREAM_PREFIX = "pagedkv:kv-events:"


def new_instance_id() -> str:
    """A fresh id for this engine (128 random bits, hex): a restarted replica is a new one."""
    return uuid.uuid4().hex


def stream_name(instance_id: str) -> str:
    return f"{STREAM_PREFIX}{instance_id}"


class EngineKVEvents:
    """The allocator's log, drained into the publisher once per step (engine thread only)."""

    def __init__(
        self,
        allocator: KVAllocator,
        publisher: KVEventPublisher,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.allocator, self.publisher, self._clock = allocator, publisher, clock
        self.log = KVEventLog()
        allocator.enable_events(self.log)  # emits AllBlocksCleared (+ what it holds)
        self.after_step()  # a reader sees the opening AllBlocksCleared before any step

    @property
    def url(self) -> str:
        return self.publisher.address.url

    @property
    def stream(self) -> str:
        return self.publisher.stream

    def after_step(self) -> None:
        """Publish what the prefix cache did since the last call (nothing when nothing
        changed), or a snapshot when the publisher wants one."""
        events = self.log.drain()
        if self.publisher.snapshot_wanted():
            # The snapshot says everything the drained events would: they are dropped.
            self.publisher.submit(KVEventBatch(self._clock(), self.snapshot()), snapshot=True)
        elif events:
            self.publisher.submit(KVEventBatch(self._clock(), tuple(events)))

    def snapshot(self) -> tuple[KVEvent, ...]:
        """``AllBlocksCleared`` and one single-block run per hash held in each medium (parents
        unknown)."""
        size = self.allocator.block_size
        events: list[KVEvent] = [AllBlocksCleared()]
        for medium, hashes in held_hashes(self.allocator):
            events.extend(BlockStored((h,), None, size, medium=medium) for h in hashes)
        return tuple(events)

    def counts(self) -> dict[str, int]:
        """The publisher's counters (``PublisherCounts``) by name."""
        return dict(vars(self.publisher.counts))

    def close(self, timeout_s: float = 5.0) -> None:
        self.publisher.close(timeout_s)


def held_hashes(allocator: KVAllocator) -> list[tuple[str, list[BlockHash]]]:
    """``(medium, hashes)``: the device prefix cache's, then a host tier's (what replaying the
    allocator's events gives, per medium)."""
    out = [(MEDIUM_DEVICE, sorted(allocator.prefix_hashes()))]
    for tier in allocator.lower_tiers():
        if tier.event_medium is not None:  # a tier that keeps its own blocks (host memory)
            out.append((tier.event_medium, sorted(tier.hashes())))
    return out


def open_kv_events(
    config: EngineConfig, allocator: KVAllocator, instance_id: str
) -> tuple[EngineKVEvents | None, list[str]]:
    """The engine side for ``config.kv_events_url`` (None without it) and its start-up lines
    (no prefix). A Redis that does not answer is not an error: events are dropped and counted
    until it does, then a snapshot goes out."""
    if not config.kv_events_url:
        return None, []
    address = parse_store_url(config.kv_events_url)  # checked by EngineConfig already
    publisher = KVEventPublisher(address, stream_name(instance_id))
    events = EngineKVEvents(allocator, publisher)
    return events, [f"KV events -> {address.url} stream {publisher.stream}"]


def describe_replica(engine, served_model_name: str, model_identity: str | None) -> dict:
    """The body of ``GET /pagedkv/info``: what a router needs to pick this replica and to read
    its events. Fixed for the process's life. The schema is documented in docs/kv_events.md;
    fields are only ever added."""
    parts = engine.parts
    events: EngineKVEvents | None = parts.kv_events
    return {
        "instance_id": parts.instance_id,
        "model": served_model_name,
        "model_identity": model_identity,
        "tokenizer": engine.tokenizer.fingerprint(),
        "page_format": parts.page_format.to_dict(),
        "allocator": parts.policy.allocator,
        "block_size": engine.allocator.block_size,
        "prefix_caching": parts.policy.prefix_caching,
        "hash_algorithm": DEFAULT_HASH_ALGORITHM,
        "max_model_len": parts.max_model_len,
        **engine.info.placement(),  # device, dtype, attention_backend
        "kv_events": None if events is None else {"url": events.url, "stream": events.stream},
        "tensor_parallel": tensor_parallel(parts),
    }


def tensor_parallel(parts) -> dict[str, int]:
    """The engine's ranks and what each holds (``/pagedkv/info``): one replica whatever its
    size (rank 0 speaks for all; its events and store keys are the whole engine's)."""
    page = parts.page_format
    heads = parts.model_config.num_heads // page.tp_size
    return {"size": page.tp_size, "heads_per_rank": heads, "kv_heads_per_rank": page.num_kv_heads}
