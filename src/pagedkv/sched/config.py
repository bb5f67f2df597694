"""``SchedulerConfig``: the scheduler's limits as one frozen, validated value for the edges."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.sched.preemption import get_victim_policy
from pagedkv.sched.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits, validated once at the edge (``Scheduler`` takes them narrowly)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    chunked_prefill: bool = True
    preemption: str = "latest_arrival"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        get_victim_policy(self.preemption)

    def build(self, allocator: KVAllocator) -> Scheduler:
        return Scheduler(
            allocator,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            chunked_prefill=self.chunked_prefill,
            victim_policy=get_victim_policy(self.preemption),
        )
