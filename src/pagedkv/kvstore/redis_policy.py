"""One Redis client policy for every part of pagedkv that talks to Redis.

The KV store client (``client.py``), the KV-event publisher (``event_publisher.py``) and the
router's event reader (``router/event_reader.py``) all follow the same rules, so that "what does
pagedkv do when Redis is slow or gone" has one answer:

* **Short timeouts**: connecting ``connect_timeout_s``, each socket read or write
  ``socket_timeout_s`` (a blocking ``XREAD`` adds the time it blocks). A hung Redis costs a
  caller about one timeout, then it is marked down.
* **No retry inside redis-py**: a failed call fails now; the caller's ``Backoff`` decides when
  to try again (a step must never stall in a library's retry loop).
* **Doubling back-off**: ``first_backoff_s`` after the first failure of an outage, doubling up
  to ``max_backoff_s``; the first success ends the outage and resets it.

Pure Python: ``redis`` is imported only when a connection is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RedisPolicy:
    """Timeouts and back-off of one Redis client (seconds; validated here)."""

    connect_timeout_s: float = 0.25
    socket_timeout_s: float = 0.5
    first_backoff_s: float = 0.25
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "socket_timeout_s", "first_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"RedisPolicy.{name} must be a finite number > 0, got {value!r}")
        if self.first_backoff_s > self.max_backoff_s:
            raise ValueError(
                f"RedisPolicy.first_backoff_s ({self.first_backoff_s}) exceeds max_backoff_s "
                f"({self.max_backoff_s})"
            )

    def connect(self, host: str, port: int, db: int = 0, *, blocking_read_s: float = 0.0):
        """A redis-py client under this policy (connects lazily, on the first call).
        ``blocking_read_s``: how long a blocking command (``XREAD BLOCK``) waits; the socket
        timeout is that plus ``socket_timeout_s``, so a silent wait is not a failure."""
        import redis  # the engine extra's dependency, imported only when Redis is used
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(
            host=host,
            port=port,
            db=db,
            socket_timeout=self.socket_timeout_s + blocking_read_s,
            socket_connect_timeout=self.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # failures surface to the caller's Backoff
        )


REDIS_POLICY = RedisPolicy()
"""The policy every component uses unless it is given one (read at construction, so a test may
replace it for the whole process)."""


def policy_or_default(policy: RedisPolicy | None) -> RedisPolicy:
    return policy if policy is not None else REDIS_POLICY


class Backoff:
    """The doubling delay of one client's outages. Not thread-safe: one owner (or a lock)."""

    def __init__(self, policy: RedisPolicy | None = None) -> None:
        self.policy = policy_or_default(policy)
        self._next_s = self.policy.first_backoff_s

    def next_delay(self) -> float:
        """The wait before the next try after a failure; the one after it doubles."""
        delay_s = self._next_s
        self._next_s = min(self._next_s * 2, self.policy.max_backoff_s)
        return delay_s

    def reset(self) -> None:
        """A call succeeded: the next outage starts at ``first_backoff_s`` again."""
        self._next_s = self.policy.first_backoff_s
