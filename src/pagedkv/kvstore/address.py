"""``--kv-store redis://HOST:PORT[/DB]``: parsed and checked once, at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pagedkv.errors import UsageError
from pagedkv.kvstore.redis_policy import RedisPolicy, policy_or_default

DEFAULT_PORT = 6379


@dataclass(frozen=True)
class StoreAddress:
    """Where the shared store listens: a Redis server (``db`` is the logical database)."""

    host: str
    port: int
    db: int = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 goes in brackets
        return f"redis://{host}:{self.port}/{self.db}"

    def connect(self, policy: RedisPolicy | None = None, blocking_read_s: float = 0.0):
        """A redis-py client for this address under ``policy`` (``redis_policy.py``: short
        timeouts, no retry of its own). Connects lazily, on the first call."""
        return policy_or_default(policy).connect(
            self.host, self.port, self.db, blocking_read_s=blocking_read_s
        )


def parse_store_url(url: str) -> StoreAddress:
    """``redis://HOST[:PORT][/DB]`` -> ``StoreAddress`` (an IPv6 HOST in brackets); a one-line
    ``UsageError`` naming the ``kv_store`` parameter for anything else (other schemes,
    credentials, a query, a port out of 1..65535 or not a number, unbalanced brackets, a bad
    database number)."""
    if not isinstance(url, str):
        raise UsageError(f"--kv-store must be a redis://HOST:PORT URL, got {url!r}", "kv_store")
    bad = f"--kv-store must be redis://HOST:PORT[/DB], got {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number or out of range; "Invalid IPv6 URL"
        raise UsageError(f"{bad}: {exc}", "kv_store") from None
    if port == 0:  # ``port or DEFAULT_PORT`` once turned an explicit 0 into 6379
        raise UsageError(f"{bad}: the port must be in 1..65535", "kv_store")
    if parts.scheme != "redis" or not parts.hostname:
        raise UsageError(bad, "kv_store")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise UsageError(f"{bad}: credentials, queries and fragments are not supported", "kv_store")
    db_text = parts.path.strip("/")
    if db_text and not db_text.isdigit():
        raise UsageError(f"{bad}: the database must be a number", "kv_store")
    return StoreAddress(parts.hostname, DEFAULT_PORT if port is None else port, int(db_text or 0))
