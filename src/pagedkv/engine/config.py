"""``EngineConfig``: everything the engine is built from, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import get_policy
from pagedkv.kvstore.address import parse_store_url
from pagedkv.pages.kv_dtypes import ENGINE_DTYPES
from pagedkv.sched.preemption import PREEMPTION_MODES, get_victim_policy
from pagedkv.units import check_block_size

MIB = 1 << 20
# Weight formats the loader knows (model/quant.py implements the quantized two).
WEIGHT_FORMATS = ("float", "int8", "int4")


@dataclass(frozen=True)
class EngineConfig:
    """``model`` None = the embedded SmolLM2-135M-Instruct. ``block_size`` None = the policy's.
    ``max_model_len`` None = min(the model's context, 2048)."""

    model: str | None = None
    dtype: str = "float32"
    weights: str = "float"  # "int8" / "int4": weight-only quantized (model/quant.py)
    policy: str = "vllm"
    block_size: int | None = None
    kv_cache_memory_bytes: int = 512 * MIB
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    preemption: str = "latest_arrival"
    # Host tier of evicted prefix blocks (engine/kv/setup.py); 0 = none.
    host_kv_memory_bytes: int = 0
    # What a preempted sequence's KV becomes: "recompute" (freed) or "swap" (copied to a host
    # pool of swap_space_bytes, copied back before it runs again; recompute when it is full).
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 0
    log_startup: bool = True
    # The shared KV store tier (kvstore/): a redis://HOST:PORT[/DB] URL; None = no store.
    kv_store: str | None = None
    # KV events (engine/kv/events.py): a redis://HOST:PORT[/DB] URL the engine publishes its
    # prefix cache's changes to (a stream per instance, for routers); None = off.
    kv_events_url: str | None = None

    def __post_init__(self) -> None:
        """Every check raises ``UsageError`` naming the field (these are the user's flags)."""
        if self.dtype not in ENGINE_DTYPES:
            raise UsageError(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}", "dtype")
        if self.weights not in WEIGHT_FORMATS:
            raise UsageError(
                f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}", "weights"
            )
        for param, lookup in (("policy", get_policy), ("preemption", get_victim_policy)):
            value = getattr(self, param)
            if not isinstance(value, str):
                raise UsageError(f"{param} must be a name, got {value!r}", param)
            try:
                lookup(value)
            except ValueError as exc:  # the registries list the choices
                raise UsageError(str(exc), param) from None
        if self.block_size is not None:
            check_block_size(self.block_size)
        host = self.host_kv_memory_bytes
        if isinstance(host, bool) or not isinstance(host, int) or host < 0:
            raise UsageError(
                f"host_kv_memory_bytes must be an integer >= 0, got {host!r}", "host_kv_memory"
            )
        if self.kv_store is not None:
            parse_store_url(self.kv_store)  # one-line UsageError naming kv_store
        if self.kv_events_url is not None:
            try:
                parse_store_url(self.kv_events_url)
            except UsageError as exc:  # the same URL rule; the message names this flag
                raise UsageError(
                    str(exc).replace("--kv-store", "--kv-events"), "kv_events"
                ) from None
        for name in ("kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {value!r}", name)
        self._check_swap()
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or self.max_model_len < 2
        ):
            raise UsageError(
                f"max_model_len must be an integer >= 2, got {self.max_model_len!r}",
                "max_model_len",
            )

    def _check_swap(self) -> None:
        """The swap fields agree (whether one block fits is checked at start-up, once the
        block size is known)."""
        if self.preemption_mode not in PREEMPTION_MODES:
            raise UsageError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
                "preemption_mode",
            )
        swap = self.swap_space_bytes
        if isinstance(swap, bool) or not isinstance(swap, int) or swap < 0:
            raise UsageError(
                f"swap_space_bytes must be an integer >= 0, got {swap!r}", "swap_space"
            )
        if self.preemption_mode == "swap" and swap == 0:
            raise UsageError("--preemption-mode swap needs a --swap-space SIZE > 0", "swap_space")
        if self.preemption_mode == "recompute" and swap:
            raise UsageError(
                "--swap-space is only used with --preemption-mode swap (recompute keeps nothing "
                "in host memory)",
                "swap_space",
            )
