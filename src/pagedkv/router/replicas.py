"""The router's view of its replicas: which are up, how loaded, what their caches hold.

``ReplicaState`` is mutated only on the router's event loop (handlers and the health loop), so
it needs no lock; the prefix index is fed from the event readers' threads and lives behind the
``IndexFeed``'s lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedkv.breaker import CircuitBreaker
from pagedkv.kvcache.events import KVEventBatch
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.router.handshake import ReplicaInfo
from pagedkv.routing import PrefixIndex, ReplicaLoad, RouteDecision, RoutingPolicy

log = logging.getLogger("pagedkv.router")


@dataclass
class ReplicaState:
    """``up``: routable now (the last health check passed and no request failed on it
    since). ``refused``: why it is kept out for good (another page format after a restart).
    ``scraped_requests``: requests in flight + queued there, from its last ``/metrics``;
    ``in_flight``: requests the router has open to it. ``load`` is the larger of the two:
    the scrape sees other clients' requests, the count sees the router's own at once."""

    url: str
    info: ReplicaInfo
    up: bool = True
    refused: str | None = None
    scraped_requests: int = 0
    in_flight: int = 0
    num_restarts: int = 0  # times it came back with a new instance id
    # Consecutive failures or timeouts before answering open it: the replica is skipped (not
    # taken out: a SIGSTOPped replica still passes nothing, a slow one may pass health checks)
    # until a probe answers. ``app`` gives each replica the configured one.
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def load(self) -> int:
        return max(self.scraped_requests, self.in_flight)

    @property
    def routable(self) -> bool:
        return self.up and self.refused is None


class IndexFeed:
    """The shared ``PrefixIndex`` fed by one KV event reader per replica (each on its own
    thread; batches are applied under one lock). ``follow`` (re)starts a replica's reader and
    forgets what the index held for it; a batch from a reader that was replaced is dropped."""

    def __init__(self, reader_factory: Callable[..., object] | None = None) -> None:
        if reader_factory is None:
            from pagedkv.router.event_reader import KVEventReader

            reader_factory = KVEventReader
        self._factory = reader_factory
        self._lock = threading.Lock()
        self._index = PrefixIndex()
        self._readers: dict[str, object] = {}

    def follow(self, replica: str, url: str, stream: str) -> object:
        """Read ``stream`` at ``url`` for ``replica`` from its start; returns the old reader
        (the caller stops it, which may take a moment) or None."""
        reader: object = None

        def on_batch(batch: KVEventBatch) -> None:
            with self._lock:
                if self._readers.get(replica) is reader:
                    self._index.apply(replica, batch.events)

        reader = self._factory(url, stream, on_batch)
        with self._lock:
            old = self._readers.get(replica)
            self._readers[replica] = reader
            self._index.drop_replica(replica)
        reader.start()  # type: ignore[attr-defined]
        return old

    def forget(self, replica: str) -> object:
        """Stop following ``replica`` and drop its entries; returns its reader to stop."""
        with self._lock:
            self._index.drop_replica(replica)
            return self._readers.pop(replica, None)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        with self._lock:
            return self._index.match(block_hashes)

    def num_blocks(self, replica: str) -> int:
        with self._lock:
            return self._index.num_blocks(replica)

    def num_evicted(self, replica: str) -> int:
        """Index entries of ``replica`` evicted by the index's memory bound (monotonic)."""
        with self._lock:
            return self._index.evicted.get(replica, 0)

    def reader(self, replica: str):
        return self._readers.get(replica)

    def readers(self) -> list:
        with self._lock:
            return list(self._readers.values())


class Chooser:
    """Asks the policy for a replica among the routable ones not tried yet."""

    def __init__(self, replicas: Sequence[ReplicaState], policy: RoutingPolicy, feed: IndexFeed):
        self.replicas, self.policy, self.feed = list(replicas), policy, feed

    def choose(
        self, block_hashes: Sequence[BlockHash], exclude: set[str]
    ) -> tuple[ReplicaState, RouteDecision] | None:
        """None when no replica is routable (or every one was tried)."""
        candidates = [r for r in self.replicas if r.routable and r.url not in exclude]
        if not candidates:
            return None
        matched: dict[str, int] = {}
        if self.policy.uses_prefix_index and block_hashes:
            names = {r.url for r in candidates}
            matched = {k: v for k, v in self.feed.match(block_hashes).items() if k in names}
        loads = [ReplicaLoad(r.url, r.load) for r in candidates]
        decision = self.policy.choose(loads, matched)
        chosen = next(r for r in candidates if r.url == decision.replica)
        return chosen, decision
