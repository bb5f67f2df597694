"""``StoreClient``: Redis behind short timeouts, where any failure is a miss.

The engine must keep serving when the store is down or slow: every call returns "nothing"
(``None`` / ``False``) instead of raising, counts the failure (``counters.errors``), and the
engine recomputes. The first failure of an outage is logged once (a warning naming the store
and the error); the calls made while it is down are skipped without touching the network until
the back-off of ``redis_policy.py`` has passed; the first success after that logs that the
store answers again. redis-py reconnects by itself on the next call.

Timeouts are the shared ``RedisPolicy``'s (a socket read or write 0.5 s by default), so a hung
store costs a step at most about one socket timeout before it is marked down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from pagedkv.kvstore.address import StoreAddress
from pagedkv.kvstore.counters import StoreCounters
from pagedkv.kvstore.redis_policy import Backoff, RedisPolicy

log = logging.getLogger("pagedkv.kvstore")

READ_CHUNK_KEYS = 16  # keys per MGET: a run stops fetching at the first chunk with a miss
WRITE_CHUNK_KEYS = 16  # SETs per pipeline round trip


class StoreClient:
    """Thread-safe (redis-py's connection pool; the outage state has a lock)."""

    def __init__(
        self,
        address: StoreAddress,
        counters: StoreCounters,
        clock: Callable[[], float] = time.monotonic,
        policy: RedisPolicy | None = None,
    ) -> None:
        import redis  # the engine extra's dependency, imported only when a store is configured

        self.address = address
        self.counters = counters
        self._clock = clock
        self._errors = (redis.RedisError, OSError)
        self._redis = address.connect(policy)  # failure = a miss
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = Backoff(policy)

    @property
    def is_down(self) -> bool:
        return self._down_since is not None

    def get_run(self, keys: Sequence[bytes]) -> list[bytes]:
        """The values of the leading run of ``keys`` that the store holds, in order: fetched
        ``READ_CHUNK_KEYS`` at a time, stopping after the first chunk with a missing key.
        Empty when the store is down or fails."""
        found: list[bytes] = []
        for i in range(0, len(keys), READ_CHUNK_KEYS):
            values = self._call(self._redis.mget, keys[i : i + READ_CHUNK_KEYS])
            if values is None:
                return found
            for v in values:
                if v is None:
                    return found
                self.counters.add(bytes_read=len(v))
                found.append(v)
        return found

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """SET every ``(key, value)`` (pipelined, no transaction); returns how many the store
        acknowledged. Items after a failure are not sent (counted as dropped by the caller)."""
        done = 0
        for i in range(0, len(items), WRITE_CHUNK_KEYS):
            chunk = items[i : i + WRITE_CHUNK_KEYS]
            if self._call(self._pipelined_set, chunk) is None:
                break
            done += len(chunk)
            self.counters.add(
                bytes_written=sum(len(v) for _, v in chunk), blocks_written=len(chunk)
            )
        return done

    def delete(self, key: bytes) -> None:
        """Remove a payload that failed verification (best effort)."""
        self._call(self._redis.delete, key)

    def ping(self) -> bool:
        return bool(self._call(self._redis.ping))

    def _pipelined_set(self, chunk: Sequence[tuple[bytes, bytes]]) -> list:
        pipe = self._redis.pipeline(transaction=False)
        for key, value in chunk:
            pipe.set(key, value)
        return pipe.execute()

    def _call(self, fn, *args):
        """``fn(*args)``, or None when the store is down (back-off not over) or the call fails."""
        with self._lock:
            if self._down_since is not None and self._clock() < self._retry_at:
                return None
        try:
            result = fn(*args)
        except self._errors as exc:
            self._failed(exc)
            return None
        if self._down_since is not None:
            self._recovered()
        return result

    def _failed(self, exc: BaseException) -> None:
        self.counters.add(errors=1)
        with self._lock:
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
                self._backoff.reset()
                log.warning(
                    "KV store %s failed (%s: %s): blocks are recomputed and not written until "
                    "it answers again (logged once per outage)",
                    self.address.url,
                    type(exc).__name__,
                    exc,
                )
            self._retry_at = now + self._backoff.next_delay()

    def _recovered(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            outage_s = self._clock() - self._down_since
            self._down_since = None
        log.warning("KV store %s answers again after %.1f s", self.address.url, outage_s)

    def close(self) -> None:
        self._redis.close()
