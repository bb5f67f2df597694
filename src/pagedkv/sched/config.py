"""``SchedulerConfig``: the scheduler's limits as one frozen, validated value for the edges."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvcache.tiers.swap_space import SwapSpace
from pagedkv.sched.preemption import PREEMPTION_MODES, get_victim_policy
from pagedkv.sched.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits, validated once at the edge (``Scheduler`` takes them narrowly).

    ``preemption`` is the victim policy (who gives way); ``preemption_mode`` what happens to
    the victim's KV: ``recompute`` (freed, recomputed later) or ``swap`` (parked in a host swap
    space of ``swap_space_slots`` token slots, i.e. ``swap_space_slots // block_size`` whole
    blocks of the allocator it is built for; recompute when it is full).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    chunked_prefill: bool = True
    preemption: str = "latest_arrival"
    preemption_mode: str = "recompute"
    swap_space_slots: int = 0

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
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"unknown preemption_mode {self.preemption_mode!r}; choose one of "
                f"{', '.join(PREEMPTION_MODES)}"
            )
        slots = self.swap_space_slots
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
            raise ValueError(f"swap_space_slots must be an integer >= 0, got {slots!r}")
        if self.preemption_mode == "swap" and slots == 0:
            raise ValueError("preemption_mode='swap' needs swap_space_slots > 0 (host KV slots)")
        if self.preemption_mode == "recompute" and slots:
            raise ValueError(
                f"swap_space_slots={slots} is only used with preemption_mode='swap' "
                "(recompute keeps nothing in host memory)"
            )

    def build(self, allocator: KVAllocator) -> Scheduler:
        """A scheduler over ``allocator``. ValueError when the swap space cannot hold one of
        its blocks (every allocator can swap: a reserved region is one block of
        ``max_model_len`` slots, a radix page one block of ``page_size``)."""
        swap_space = None
        if self.preemption_mode == "swap":
            num_host_blocks = self.swap_space_slots // allocator.block_size
            if num_host_blocks < 1:
                raise ValueError(
                    f"swap_space_slots={self.swap_space_slots} holds no whole KV block of "
                    f"{allocator.block_size} tokens (the allocator's block size)"
                )
            swap_space = SwapSpace(num_host_blocks)
        return Scheduler(
            allocator,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            chunked_prefill=self.chunked_prefill,
            victim_policy=get_victim_policy(self.preemption),
            swap_space=swap_space,
        )
