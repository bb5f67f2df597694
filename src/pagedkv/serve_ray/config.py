"""``ServeRayConfig``: what a pagedkv Serve application is, validated once at the edge (the
``serve --replicas`` flags or a Serve config's ``args``), before Ray is contacted.

Imports neither ray nor torch. The engine and HTTP configs are ``pagedkv serve``'s own
(``EngineConfig``, ``ServerConfig``): every replica builds its engine from the one
``EngineConfig``, so the replicas agree on page format, block size and hash by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.routing import ROUTING_POLICIES, build_policy
from pagedkv.serve_ray.hints import DEFAULT_TTL_S
from pagedkv.serve_ray.stats import DEFAULT_MAX_BLOCKS, MAX_BLOCKS_LIMIT

# pagedkv's policies, plus Serve's own default router (two random replicas, the shorter queue).
POWER_OF_TWO = "power-of-two"
REPLICA_ROUTINGS = (*ROUTING_POLICIES, POWER_OF_TWO)
ROUTER_CLASS = "pagedkv.serve_ray.request_router:PagedKVRequestRouter"
APP_NAME = "pagedkv"
# Requests Serve lets one replica hold before queueing them in the router. The engine batches
# and queues fairly itself (server/engine_loop.py); Serve's default of 5 would cap its batch.
DEFAULT_MAX_ONGOING_REQUESTS = 256
DEFAULT_STATS_PERIOD_S = 0.5


@dataclass(frozen=True)
class ServeRayConfig:
    """``engine`` / ``server``: ``pagedkv serve``'s configs (``server.host``/``port`` is where
    Serve's HTTP proxy listens). ``num_replicas``: a fixed count; ``max_replicas`` > it turns
    on Serve's autoscaling between the two (``target_ongoing_requests`` per replica).
    ``routing``: a ``pagedkv.routing`` policy or ``power-of-two`` (Serve's default router).
    ``stats_period_s``: how often Serve polls each replica's load and prefix blocks.
    ``replica_num_cpus`` / ``replica_num_gpus``: each engine replica's Ray resources.
    ``ray_address``: a running Ray to join (None: start a local one). Invalid values raise
    ``UsageError`` naming the flag."""

    engine: Any  # EngineConfig (typed loosely: this module imports no torch)
    server: Any  # ServerConfig
    num_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    routing: str = "prefix-aware"
    balance_abs: int = 4
    balance_rel: float = 0.25
    stats_period_s: float = DEFAULT_STATS_PERIOD_S
    hint_ttl_s: float = DEFAULT_TTL_S  # what a router sent counts as held this long (0: off)
    max_stats_blocks: int = DEFAULT_MAX_BLOCKS
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    ray_address: str | None = None
    ray_num_cpus: int | None = None  # a local Ray's CPUs (None: the machine's)
    app_name: str = APP_NAME
    # P/D as a Serve graph (``pd.py``): ``prefill_replicas`` > 0 adds a prefill deployment of
    # ``prefill_engine`` (default: ``engine``); ``pd_decode`` / ``pd_prefill`` are each side's
    # ``PDConfig`` (role, store, kv_import, group, timeouts, breaker).
    prefill_replicas: int = 0
    prefill_engine: Any = None
    pd_decode: Any = None
    pd_prefill: Any = None

    def __post_init__(self) -> None:
        self._check_replicas()
        self._check_knobs()

    def _check_replicas(self) -> None:
        if not _is_int(self.num_replicas) or self.num_replicas < 1:
            raise UsageError(
                f"--replicas must be an integer >= 1, got {self.num_replicas!r}", "replicas"
            )
        if self.max_replicas is not None and (
            not _is_int(self.max_replicas) or self.max_replicas < self.num_replicas
        ):
            raise UsageError(
                f"--max-replicas must be an integer >= --replicas "
                f"({self.num_replicas}), got {self.max_replicas!r}",
                "max_replicas",
            )
        if self.routing not in REPLICA_ROUTINGS:
            raise UsageError(
                f"unknown --replica-routing {self.routing!r}; choose one of "
                f"{', '.join(REPLICA_ROUTINGS)}",
                "replica_routing",
            )
        if self.routing != POWER_OF_TWO:
            build_policy(self.routing, balance_abs=self.balance_abs, balance_rel=self.balance_rel)

    def _check_knobs(self) -> None:
        for flag, value in (
            ("--stats-period", self.stats_period_s),
            ("--target-ongoing-requests", self.target_ongoing_requests),
        ):
            if not (isinstance(value, (int, float)) and value > 0):
                raise UsageError(f"{flag} must be > 0, got {value!r}", flag[2:].replace("-", "_"))
        if not _is_int(self.max_stats_blocks) or not 0 <= self.max_stats_blocks <= MAX_BLOCKS_LIMIT:
            raise UsageError(
                f"max_stats_blocks must be an integer in [0, {MAX_BLOCKS_LIMIT}], "
                f"got {self.max_stats_blocks!r}",
                "max_stats_blocks",
            )
        if not _is_int(self.max_ongoing_requests) or self.max_ongoing_requests < 1:
            raise UsageError(
                f"--max-ongoing-requests must be an integer >= 1, got "
                f"{self.max_ongoing_requests!r}",
                "max_ongoing_requests",
            )
        for flag, value in (
            ("--replica-cpus", self.replica_num_cpus),
            ("--replica-gpus", self.replica_num_gpus),
            ("--hint-ttl", self.hint_ttl_s),
        ):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise UsageError(f"{flag} must be >= 0, got {value!r}", flag[2:].replace("-", "_"))
        if self.ray_num_cpus is not None and (
            not _is_int(self.ray_num_cpus) or self.ray_num_cpus < 1
        ):
            raise UsageError(
                f"--ray-num-cpus must be an integer >= 1, got {self.ray_num_cpus!r}", "ray_num_cpus"
            )
        if not _is_int(self.prefill_replicas) or self.prefill_replicas < 0:
            raise UsageError(
                f"--prefill-replicas must be an integer >= 0, got {self.prefill_replicas!r}",
                "prefill_replicas",
            )
        if self.prefill_replicas and (self.pd_decode is None or self.pd_prefill is None):
            raise UsageError(
                "--prefill-replicas needs both sides' P/D configs (--kv-store)", "prefill_replicas"
            )
        if self.ray_address is not None and not self.ray_address.strip():
            raise UsageError("--ray-address must not be empty", "ray_address")

    @property
    def router_kwargs(self) -> dict[str, Any]:
        """``initialize_state``'s arguments of ``PagedKVRequestRouter`` (JSON, as Serve wants)."""
        return {
            "policy": self.routing,
            "balance_abs": self.balance_abs,
            "balance_rel": self.balance_rel,
            "hint_ttl_s": self.hint_ttl_s,
        }

    @property
    def serve_logging(self) -> dict[str, Any]:
        """Serve's ``logging_config``: its INFO lines (one per request and replica call) only
        with ``--log-level debug``."""
        debug = self.server.log_level in ("debug", "trace")
        return {"log_level": "DEBUG" if debug else "WARNING", "enable_access_log": debug}

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        if self.max_replicas is None or self.max_replicas == self.num_replicas:
            return None
        return {
            "min_replicas": self.num_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
