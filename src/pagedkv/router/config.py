"""``RouterConfig``: what ``pagedkv route`` was asked to do, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.breaker import CircuitBreaker
from pagedkv.errors import UsageError
from pagedkv.kvstore.address import parse_store_url
from pagedkv.routing import ROUTING_POLICIES, build_policy
from pagedkv.urls import http_base_url

DEFAULT_PORT = 8080
DEFAULT_HEALTH_INTERVAL_S = 1.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Caps on what the router holds of one replica's answer (docs/routing.md): one server-sent event
# (a token's chunk is ~100 bytes; with top_logprobs 20, a few KiB) and one non-streaming body
# (n x max_tokens with logprobs can be large; past this, stream it).
DEFAULT_MAX_EVENT_BYTES = 8 << 20
DEFAULT_MAX_ANSWER_BYTES = 64 << 20


def normalize_replica_url(url: str) -> str:
    """``http(s)://HOST:PORT`` without a trailing ``/`` or ``/v1`` (the router appends the
    routes); ``UsageError`` for anything else (``urls.http_base_url``'s rule)."""
    return http_base_url(url, "--replica")


def check_kv_events_url(url: str) -> None:
    """``--kv-events``: the store's ``redis://`` rule (``kvstore/address.py``), this flag named."""
    try:
        parse_store_url(url)
    except UsageError as exc:  # its message names --kv-store; keep only the reason
        reason = str(exc).partition(f"got {url!r}")[2].lstrip(": ")
        raise UsageError(
            f"--kv-events {url!r} is not a redis://HOST:PORT URL"
            + (f": {reason}" if reason else ""),
            "kv_events",
        ) from None


@dataclass(frozen=True)
class RouterConfig:
    """``replica_urls``: the replicas' base URLs (normalized, distinct). ``kv_events_url``:
    where the replicas publish KV events as seen from the router (None: each replica's own
    ``/pagedkv/info`` says). ``model``: the tokenizer's model path (None: the embedded model).
    ``api_key``: what clients must send, and what the router sends to the replicas.
    ``wait_s``: how long start-up waits for every replica to answer ``/pagedkv/info``.
    ``max_event_bytes`` / ``max_answer_bytes``: the most the router holds of one event of a
    replica's stream / of one non-streaming answer (past it: an error event / a 502).
    Invalid values raise ``UsageError`` naming the flag."""

    replica_urls: tuple[str, ...]
    policy: str = "prefix-aware"
    kv_events_url: str | None = None
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    balance_abs: int = 4
    balance_rel: float = 0.25
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    wait_s: float = 0.0
    log_level: str = "info"
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    # Per replica (``breaker.py``): this many consecutive failures or timeouts before answering
    # stop the router sending to it for ``breaker_backoff_s`` (doubling per failed probe).
    breaker_failures: int = 3
    breaker_backoff_s: float = 5.0

    def make_breaker(self) -> CircuitBreaker:
        """A fresh breaker for one replica (max back-off: 12 x the first)."""
        return CircuitBreaker(
            self.breaker_failures, self.breaker_backoff_s, 12 * self.breaker_backoff_s
        )

    def __post_init__(self) -> None:
        if not self.replica_urls:
            raise UsageError("give at least one --replica URL", "replica")
        urls = tuple(normalize_replica_url(u) for u in self.replica_urls)
        dup = next((u for i, u in enumerate(urls) if u in urls[:i]), None)
        if dup is not None:
            raise UsageError(f"--replica {dup} is given twice", "replica")
        object.__setattr__(self, "replica_urls", urls)
        if self.policy not in ROUTING_POLICIES:
            raise UsageError(
                f"unknown --policy {self.policy!r}; choose one of {', '.join(ROUTING_POLICIES)}",
                "policy",
            )
        build_policy(self.policy, balance_abs=self.balance_abs, balance_rel=self.balance_rel)
        if self.kv_events_url is not None:
            check_kv_events_url(self.kv_events_url)
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in 0..65535, got {self.port}", "port")
        for flag, value in (
            ("--health-interval", self.health_interval_s),
            ("--request-timeout", self.request_timeout_s),
            ("--connect-timeout", self.connect_timeout_s),
        ):
            if not value > 0:
                raise UsageError(f"{flag} must be > 0 seconds, got {value}", flag[2:])
        if not self.wait_s >= 0:
            raise UsageError(f"--wait must be >= 0 seconds, got {self.wait_s}", "wait")
        for name, cap in (
            ("max_event_bytes", self.max_event_bytes),
            ("max_answer_bytes", self.max_answer_bytes),
        ):
            if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1024:
                raise UsageError(f"{name} must be an integer >= 1024, got {cap!r}", name)

        self.make_breaker()  # its own checks name the bad value

    def make_policy(self):
        """A fresh routing policy (``pagedkv.routing``), as configured."""
        return build_policy(self.policy, balance_abs=self.balance_abs, balance_rel=self.balance_rel)
