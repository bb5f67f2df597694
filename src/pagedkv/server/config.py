"""``ServerConfig``: how the HTTP edge is exposed, validated once when it is built."""

from __future__ import annotations

from dataclasses import dataclass

API_KEY_ENV = "PAGEDKV_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    """``host`` defaults to loopback: exposing the server is an explicit choice. ``port`` 0
    asks the OS for a free port. ``api_key`` None = no authentication; otherwise every ``/v1``
    route needs ``Authorization: Bearer <api_key>``. ``served_model_name`` is the one id
    ``/v1/models`` lists and requests may name."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    graceful_shutdown_s: float = 5.0  # how long open streams may finish when stopping

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if not self.host:
            raise ValueError("host must not be empty")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty (omit it to disable authentication)")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
