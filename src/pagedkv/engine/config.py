"""``EngineConfig``: everything the engine is built from, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kvcache.policies import get_policy
from pagedkv.planner.kv_dtypes import ENGINE_DTYPES
from pagedkv.sched.preemption import get_victim_policy

MIB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """``model`` None = the embedded SmolLM2-135M-Instruct. ``block_size`` None = the policy's.
    ``max_model_len`` None = min(the model's context, 2048)."""

    model: str | None = None
    dtype: str = "float32"
    policy: str = "vllm"
    block_size: int | None = None
    kv_cache_memory_bytes: int = 512 * MIB
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    preemption: str = "latest_arrival"
    log_startup: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}")
        get_policy(self.policy)  # raises with the list of choices
        get_victim_policy(self.preemption)
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise ValueError(f"block_size must be an integer >= 1 token, got {self.block_size!r}")
        for name in ("kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
