"""``PDConfig``: a ``pagedkv serve`` instance's part in a prefill/decode pair, checked at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pagedkv.errors import UsageError

ROLES = ("both", "prefill", "decode")
# strict: the decode side reads only pages of its own format; relayout: it also re-pages the
# prefill side's blocks when only the block size differs (``relayout.py``).
KV_IMPORT_MODES = ("strict", "relayout")
DEFAULT_PEER_WAIT_S = 30.0
DEFAULT_PREFILL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PDConfig:
    """``role`` ``both`` (the default) is a normal single instance. ``prefill`` and ``decode``
    need the shared store (``kv_store``, a ``redis://`` URL, owned by the engine's config);
    ``decode`` also needs ``prefill_url``, the prefill instance's HTTP base URL.
    ``peer_wait_s``: how long a decode instance waits at start-up for a prefill instance's
    page format to appear in the store. ``group``: instances pair only within one group (one
    store may serve several pairs). Invalid values raise ``UsageError`` naming the flag."""

    role: str = "both"
    prefill_url: str | None = None
    kv_import: str = "strict"
    group: str = "default"
    peer_wait_s: float = DEFAULT_PEER_WAIT_S
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    kv_store: str | None = None

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
        for name, value in (("--pd-wait", self.peer_wait_s),
                            ("--prefill-timeout", self.prefill_timeout_s)):  # fmt: skip
            if not value > 0:
                raise UsageError(f"{name} must be > 0 seconds, got {value!r}", name[2:])
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
            parts = urlsplit(self.prefill_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UsageError(
                    f"--prefill-url must be an http(s)://HOST:PORT URL, got {self.prefill_url!r}",
                    "prefill_url",
                )

    @property
    def is_pair(self) -> bool:
        return self.role != "both"
