"""``SchedulerConfig``: the scheduler's limits as one frozen, validated value for the edges."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvcache.tiers.swap_space import SwapSpace
from pagedkv.sched.limits import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREEMPTION,
    DEFAULT_PREEMPTION_MODE,
    check_limits,
    check_preemption,
    check_swap_space,
)
from pagedkv.sched.preemption import get_victim_policy
from pagedkv.sched.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits, validated once at the edge (``Scheduler`` takes them narrowly).

    ``preemption`` is the victim policy (who gives way); ``preemption_mode`` what happens to
    the victim's KV: ``recompute`` (freed, recomputed later) or ``swap`` (parked in a host swap
    space of ``swap_space_slots`` token slots, i.e. ``swap_space_slots // block_size`` whole
    blocks of the allocator it is built for; recompute when it is full).

    It owns these limits: their defaults and rules are ``sched/limits.py``'s, which
    ``EngineConfig`` reads rather than keeping its own. Bad values raise ``UsageError`` (a
    ``ValueError``) naming the field.
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    chunked_prefill: bool = True
    preemption: str = DEFAULT_PREEMPTION
    preemption_mode: str = DEFAULT_PREEMPTION_MODE
    swap_space_slots: int = 0

    def __post_init__(self) -> None:
        check_limits(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
        check_preemption(self.preemption, self.preemption_mode)
        check_swap_space(self.preemption_mode, self.swap_space_slots, "swap_space_slots")

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
