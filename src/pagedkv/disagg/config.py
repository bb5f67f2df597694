"""``PDConfig``: a ``pagedkv serve`` instance's part in a prefill/decode pair, checked at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.urls import http_base_url

ROLES = ("both", "prefill", "decode")
# strict: the decode side reads only pages of its own format; relayout: it also re-pages the
# prefill side's blocks when only the block size differs (``relayout.py``).
KV_IMPORT_MODES = ("strict", "relayout")
DEFAULT_PEER_WAIT_S = 30.0
DEFAULT_PREFILL_TIMEOUT_S = 120.0
# The prefill client's circuit breaker (``pagedkv.breaker``): after this many consecutive failed
# or timed-out calls no request asks the prefill instance for the back-off, then one probes; a
# failed probe doubles the back-off, up to the cap.
DEFAULT_BREAKER_FAILURES = 3
DEFAULT_BREAKER_BACKOFF_S = 5.0
MAX_BREAKER_BACKOFF_S = 60.0


@dataclass(frozen=True)
class PDConfig:
    """``role`` ``both`` (the default) is a normal single instance. ``prefill`` and ``decode``
    need the shared store (``kv_store``, a ``redis://`` URL, owned by the engine's config);
    ``decode`` also needs ``prefill_url``, the prefill instance's HTTP base URL.
    ``peer_wait_s``: how long a decode instance waits at start-up for a prefill instance's
    page format to appear in the store. ``group``: instances pair only within one group (one
    store may serve several pairs). ``breaker_failures`` / ``breaker_backoff_s``: the prefill
    client's circuit breaker (consecutive failures that open it; its first back-off, doubled
    after each failed probe up to ``max(MAX_BREAKER_BACKOFF_S, breaker_backoff_s)``).
    ``prefill_url`` is kept normalized (no trailing ``/`` or ``/v1``). Invalid values raise
    ``UsageError`` naming the flag."""

    role: str = "both"
    prefill_url: str | None = None
    kv_import: str = "strict"
    group: str = "default"
    peer_wait_s: float = DEFAULT_PEER_WAIT_S
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    kv_store: str | None = None
    breaker_failures: int = DEFAULT_BREAKER_FAILURES
    breaker_backoff_s: float = DEFAULT_BREAKER_BACKOFF_S

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}", "role")
        if self.kv_import not in KV_IMPORT_MODES:
            raise UsageError(
                f"--kv-import must be one of {', '.join(KV_IMPORT_MODES)}, got {self.kv_import!r}",
                "kv_import",
            )
        if not self.group or any(c.isspace() or c == ":" for c in self.group):
            raise UsageError(
                f"--pd-group must be a non-empty name without spaces or ':', got {self.group!r}",
                "group",
            )
        for name, value in (
            ("--pd-wait", self.peer_wait_s),
            ("--prefill-timeout", self.prefill_timeout_s),
            ("--prefill-breaker-backoff", self.breaker_backoff_s),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise UsageError(
                    f"{name} must be a finite number > 0 seconds, got {value!r}",
                    name[2:].replace("-", "_"),
                )
        n = self.breaker_failures
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(
                f"--prefill-breaker-failures must be an integer >= 1, got {n!r}",
                "prefill_breaker_failures",
            )
        if self.role == "both":
            if self.prefill_url is not None:
                raise UsageError("--prefill-url is only used with --role decode", "prefill_url")
            if self.kv_import != "strict":
                raise UsageError("--kv-import is only used with --role decode", "kv_import")
            return
        if self.kv_store is None:
            raise UsageError(
                f"--role {self.role} needs --kv-store redis://HOST:PORT (the two instances "
                "exchange their page format and KV blocks through it)",
                "kv_store",
            )
        if self.role == "prefill":
            if self.prefill_url is not None:
                raise UsageError("--prefill-url is only used with --role decode", "prefill_url")
            if self.kv_import != "strict":
                raise UsageError("--kv-import is only used with --role decode", "kv_import")
        else:
            if self.prefill_url is None:
                raise UsageError(
                    "--role decode needs --prefill-url http://HOST:PORT (the prefill instance)",
                    "prefill_url",
                )
            object.__setattr__(
                self, "prefill_url", http_base_url(self.prefill_url, "--prefill-url")
            )

    @property
    def is_pair(self) -> bool:
        return self.role != "both"

    @property
    def breaker_max_backoff_s(self) -> float:
        return max(MAX_BREAKER_BACKOFF_S, self.breaker_backoff_s)
