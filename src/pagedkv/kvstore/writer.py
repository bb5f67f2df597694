"""``StoreWriter``: write-through of full blocks, off the step's thread.

After a forward pass the engine copies the step's newly full blocks out of the pool (their
bodies: the device blocks may be reused next step) and ``submit``s ``(block hash, body)``
pairs; a daemon thread encodes them (header, CRC-32, one join) and sends them to the store in
pipelined batches. The step therefore pays only the copy, never the encoding or the network. What the queue
cannot hold (``max_queued_bytes``) or the store refuses is dropped and counted
(``counters.writes_dropped``): a dropped block is only a later miss, never wrong KV.
``flush`` waits until everything submitted so far was sent (tests, shutdown, benchmarks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from pagedkv.background import QueueThread
from pagedkv.kvstore.client import StoreClient

Encode = Callable[[bytes, memoryview], tuple[bytes, bytes]]  # (hash, body) -> (key, payload)

log = logging.getLogger("pagedkv.kvstore")

DEFAULT_MAX_QUEUED_BYTES = 256 << 20


class StoreWriter(QueueThread):
    """One daemon thread per engine; ``submit`` and ``flush`` may be called from any thread."""

    def __init__(
        self, client: StoreClient, encode: Encode, max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    ) -> None:
        super().__init__("pagedkv-kv-store")  # the queue holds batches of (hash, body) pairs
        self._client = client
        self._encode = encode
        self._max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._start()

    def submit(self, items: Sequence[tuple[bytes, memoryview]]) -> int:
        """Queue ``(block hash, body)`` pairs (bodies the caller no longer writes); returns how
        many were accepted (the rest dropped and counted). Never blocks on the store; items are
        skipped at once while it is down."""
        counters = self._client.counters
        if not items:
            return 0
        if self._client.is_down or self._closed:
            counters.add(writes_dropped=len(items))
            return 0
        accepted: list[tuple[bytes, memoryview]] = []
        with self._cond:
            for key, value in items:
                if self._queued_bytes + value.nbytes > self._max_queued_bytes:
                    break
                accepted.append((key, value))
                self._queued_bytes += value.nbytes
            if accepted:
                self._queue.append(accepted)
                self._cond.notify()
        if len(accepted) < len(items):
            counters.add(writes_dropped=len(items) - len(accepted))
        return len(accepted)

    def _after_close(self) -> None:
        """Nothing: the client belongs to the store tier, which closes it."""

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                batch = self._queue.popleft()
                self._in_flight += 1
            try:
                sent = self._client.put_many([self._encode(h, body) for h, body in batch])
            except Exception:  # the writer must outlive one bad batch (client errors are caught)
                log.exception("KV store writer: a batch of %d blocks failed", len(batch))
                sent = 0
            try:
                if sent < len(batch):
                    self._client.counters.add(writes_dropped=len(batch) - sent)
            finally:
                with self._cond:
                    self._queued_bytes -= sum(body.nbytes for _, body in batch)
                    self._in_flight -= 1
                    self._cond.notify_all()
