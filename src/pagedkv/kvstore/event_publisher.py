"""``KVEventPublisher``: the engine's KV event batches, appended to a Redis stream off-thread.

The engine thread ``submit``s one ``KVEventBatch`` per step (only appending to a bounded queue,
never touching the network); a daemon thread encodes the batches (JSON) and ``XADD``s them, in
order, to the stream (field ``batch``, ``MAXLEN ~ maxlen``), pipelining what has queued up.

A stream, not pub/sub: a stream keeps every entry in order until trimmed, so a router started
later (or restarted) replays it from the start and resumes after the last entry it read;
pub/sub delivers only to those listening at that moment.

Outages: Redis down, slow, or the queue full. The engine never blocks or fails: a batch that
cannot be sent is dropped and counted (the first failure of an outage is logged once). A
dropped batch leaves readers with a wrong view, so from then on the publisher is *lost*: it
drops every ordinary batch (they are deltas on a state readers no longer have) until a
*snapshot* batch (``AllBlocksCleared`` + every hash held now) is submitted. The snapshot is
taken on the engine thread, which alone may read the allocator: the publisher raises
``snapshot_wanted`` once Redis answers again (it pings with a back-off while lost), and the
engine's next drain submits the snapshot instead of the step's events (``engine/kv/events.py``). It
also asks for one every ``snapshot_every_batches`` batches, so that a stream trimmed by
``MAXLEN`` still holds a snapshot a late reader can start from.

A stream Redis refuses to append to for good (a third party's ``XADD`` with the largest ID,
``18446744073709551615-18446744073709551615``, exhausts the IDs; a ``SET`` on the key makes it
another type) is this replica's own: the publisher deletes it and publishes a snapshot into the
fresh one (``stream_resets``, logged once). Readers notice the reset (``router/event_reader.py``)
and replay the new stream from its start, which is that snapshot. A refusal right after a reset
is handled like an outage (back-off), so a key someone keeps spoiling costs a retry per back-off,
not a snapshot per step.

Each batch is one entry, or several when it is over the readers' caps
(``kvstore/event_entries.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedkv.background import QueueThread
from pagedkv.kvcache.events import KVEventBatch
from pagedkv.kvstore.address import StoreAddress
from pagedkv.kvstore.event_entries import entry_texts
from pagedkv.kvstore.redis_policy import Backoff, RedisPolicy, policy_or_default

log = logging.getLogger("pagedkv.kv_events")

BATCH_FIELD = "batch"
DEFAULT_MAXLEN = 100_000  # entries kept in the stream (approximately: MAXLEN ~)
DEFAULT_MAX_QUEUED_BATCHES = 4096
PIPELINE_BATCHES = 64  # XADDs per round trip when batches queued up
# Redis's answers to an XADD on a stream that can never take another entry (deleting the
# stream is the way out): the IDs are exhausted, an explicit ID below the top, another type.
STREAM_UNUSABLE = (
    "exhausted the last possible ID",
    "equal or smaller than the target stream",
    "WRONGTYPE",
)


@dataclass
class PublisherCounts:
    """Counters (monotonic; read from any thread, written by one thread each)."""

    events_published: int = 0
    batches_published: int = 0
    events_dropped: int = 0
    batches_dropped: int = 0
    publish_errors: int = 0  # failed XADD round trips and failed pings while lost
    snapshots_published: int = 0
    stream_resets: int = 0  # the stream deleted because Redis refused XADD to it for good


class KVEventPublisher(QueueThread):
    """One stream, one daemon thread. ``submit`` and ``snapshot_wanted``: the engine thread;
    ``flush`` and ``close``: any thread."""

    def __init__(
        self,
        address: StoreAddress,
        stream: str,
        *,
        maxlen: int = DEFAULT_MAXLEN,
        max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES,
        snapshot_every_batches: int | None = None,
        policy: RedisPolicy | None = None,
    ) -> None:
        import redis  # the engine extra's dependency, imported only when events are on

        super().__init__("pagedkv-kv-events")  # the queue holds (batch, is a snapshot) pairs
        self.address, self.stream, self.maxlen = address, stream, maxlen
        self.counts = PublisherCounts()
        self._errors = (redis.RedisError, OSError)
        self._refused = redis.ResponseError  # Redis answered, with an error (not an outage)
        self.policy = policy_or_default(policy)
        self._redis = address.connect(self.policy)  # failure = a drop
        self._backoff = Backoff(self.policy)
        self._max_queued = max_queued_batches
        self._snapshot_every = snapshot_every_batches or max(maxlen // 2, 1)
        self._since_snapshot = 0
        self._lost = False  # batches were dropped: readers are wrong until a snapshot
        self._snapshot_wanted = False
        self._down_since: float | None = None
        self._just_reset = False  # the stream was reset and nothing was published since
        self._start()

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    def snapshot_wanted(self) -> bool:
        """Whether the next batch should be a snapshot (after an outage, or periodically)."""
        return self._snapshot_wanted

    def submit(self, batch: KVEventBatch, *, snapshot: bool = False) -> bool:
        """Queue ``batch`` (``snapshot``: it starts with ``AllBlocksCleared`` and lists every
        hash held); False when it was dropped (counted). Never blocks on Redis."""
        with self._cond:
            full = len(self._queue) >= self._max_queued
            if self._closed or full or (self._lost and not snapshot):
                if full and not self._lost:
                    log.warning(
                        "KV events: the publish queue is full (%d batches); dropping "
                        "until a snapshot can be sent",
                        self._max_queued,
                    )
                self._lost = self._lost or full
                self._snapshot_wanted = self._snapshot_wanted or (full and not self.is_down)
                self._count_dropped([batch])
                return False
            if snapshot:
                self._lost = self._snapshot_wanted = False
            self._queue.append((batch, snapshot))
            self._cond.notify()
        return True

    def _after_close(self) -> None:
        self._redis.close()

    # -- the publisher's thread ------------------------------------------------------------

    def _run(self) -> None:
        backoff_s = self._backoff.next_delay()
        while True:
            with self._cond:
                probing = self._lost and self.is_down
                if probing:  # wait for Redis, not for batches (they are dropped while lost)
                    self._cond.wait(backoff_s)
                    if self._closed:
                        return
                else:
                    self._cond.wait_for(lambda: self._queue or self._closed)
                    if not self._queue:
                        return  # closed and drained
                    n = min(len(self._queue), PIPELINE_BATCHES)
                    chunk = [self._queue.popleft() for _ in range(n)]
                    self._in_flight += 1
            if probing:
                if self._ping():
                    self._backoff.reset()
                backoff_s = self._backoff.next_delay()
                continue
            try:
                self._send(chunk)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _send(self, chunk: list[tuple[KVEventBatch, bool]]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for batch, _ in chunk:
                for text in entry_texts(batch):
                    pipe.xadd(
                        self.stream, {BATCH_FIELD: text}, maxlen=self.maxlen, approximate=True
                    )
            pipe.execute()
        except self._refused as exc:
            if any(s in str(exc) for s in STREAM_UNUSABLE):
                self._reset_stream(exc, [b for b, _ in chunk])
            else:  # e.g. OOM: Redis may take it later, like after an outage
                self._failed(exc, [b for b, _ in chunk])
            return
        except self._errors as exc:
            self._failed(exc, [b for b, _ in chunk])
            return
        except Exception:  # the thread must outlive one bad batch
            log.exception("KV events: a chunk of %d batches failed to encode", len(chunk))
            self._failed(None, [b for b, _ in chunk])
            return
        c = self.counts
        c.batches_published += len(chunk)
        c.events_published += sum(len(b.events) for b, _ in chunk)
        c.snapshots_published += sum(snap for _, snap in chunk)
        for _, snap in chunk:
            self._since_snapshot = 0 if snap else self._since_snapshot + 1
        if self._since_snapshot >= self._snapshot_every:
            self._snapshot_wanted = True
        self._just_reset = False
        if self._down_since is not None:
            self._recovered()

    def _reset_stream(self, exc: BaseException, batches: list[KVEventBatch]) -> None:
        """Delete the stream Redis refuses to append to; the next drain sends a snapshot."""
        try:
            self._redis.delete(self.stream)
        except self._errors as del_exc:
            self._failed(del_exc, batches)
            return
        c = self.counts
        c.stream_resets += 1
        c.publish_errors += not self._just_reset  # else _failed counts it
        if c.stream_resets == 1:
            log.warning(
                "KV events: Redis refuses XADD to %s (%s); the stream was deleted and a "
                "snapshot follows (logged once, counted in stream_resets)",
                self.stream,
                exc,
            )
        # Twice in a row: someone keeps spoiling the key; back off as in an outage.
        self._failed(exc if self._just_reset else None, batches)
        self._just_reset = True

    def _failed(self, exc: BaseException | None, batches: list[KVEventBatch]) -> None:
        """Drop ``batches`` and everything queued behind them; lost until a snapshot."""
        with self._cond:
            dropped = batches + [b for b, _ in self._queue]
            self._queue.clear()
            self._count_dropped(dropped)
            self._lost, self._snapshot_wanted = True, False
            if exc is None:
                self._snapshot_wanted = True  # Redis is fine: resync at once
                return
            self.counts.publish_errors += 1
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning(
                    "KV events: XADD to %s on %s failed (%s: %s); events are dropped and "
                    "counted until it answers, then a snapshot is published (logged once per "
                    "outage)",
                    self.stream,
                    self.address.url,
                    type(exc).__name__,
                    exc,
                )

    def _ping(self) -> bool:
        try:
            self._redis.ping()
        except self._errors:
            self.counts.publish_errors += 1
            return False
        self._recovered()
        with self._cond:
            self._snapshot_wanted = True  # the engine's next drain sends the snapshot
        return True

    def _recovered(self) -> None:
        if self._down_since is not None:
            outage_s = time.monotonic() - self._down_since
            self._down_since = None
            log.warning(
                "KV events: %s answers again after %.1f s; publishing a snapshot",
                self.address.url,
                outage_s,
            )

    def _count_dropped(self, batches: list[KVEventBatch]) -> None:
        self.counts.batches_dropped += len(batches)
        self.counts.events_dropped += sum(len(b.events) for b in batches)
