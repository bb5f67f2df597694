"""``ServerConfig``: how the HTTP edge is exposed, validated once when it is built."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError

API_KEY_ENV = "PAGEDKV_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Samples (prompts x n) one HTTP request may ask for. OpenAI allows batches of up to 2,048
# prompts; far more than one request should hold of the engine at a time.
DEFAULT_MAX_SAMPLES_PER_REQUEST = 1024


@dataclass(frozen=True)
class ServerConfig:
    """``host`` defaults to loopback: exposing the server is an explicit choice. ``port`` 0
    asks the OS for a free port. ``api_key`` None = no authentication; otherwise every route
    but ``/health`` and ``/metrics`` needs ``Authorization: Bearer <api_key>``.
    ``served_model_name`` is the one id ``/v1/models`` lists and requests may name.
    ``max_samples_per_request`` caps prompts x ``n`` of one request (a 400 beyond it).
    Invalid values raise ``UsageError`` naming the flag."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    graceful_shutdown_s: float = 5.0  # how long open streams may finish when stopping
    max_samples_per_request: int = DEFAULT_MAX_SAMPLES_PER_REQUEST

    def __post_init__(self) -> None:
        if not self.served_model_name.strip():
            raise UsageError("--served-model-name must not be empty", "served_model_name")
        if not self.host:
            raise UsageError("--host must not be empty", "host")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be an integer in [0, 65535], got {self.port!r}", "port")
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError(
                "the API key must not be empty (omit it to disable authentication)", "api_key"
            )
        if self.log_level not in LOG_LEVELS:
            raise UsageError(
                f"--log-level must be one of {LOG_LEVELS}, got {self.log_level!r}", "log_level"
            )
        if not self.graceful_shutdown_s >= 0:
            raise UsageError(
                f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}",
                "graceful_shutdown_s",
            )
        cap = self.max_samples_per_request
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise UsageError(
                f"--max-samples-per-request must be an integer >= 1, got {cap!r}",
                "max_samples_per_request",
            )
