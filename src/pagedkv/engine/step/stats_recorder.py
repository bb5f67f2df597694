"""``StatsRecorder``: the engine's pool, queues and counters sampled after every step, made
into the ``EngineSnapshot`` and ``EngineStats`` the edges read (``engine/stats.py``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedkv.engine.stats import EngineSnapshot, EngineStats
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvcache.tiers.counts import TierCounts
from pagedkv.kvstore.counters import StoreCounters
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.scheduler import Scheduler

if TYPE_CHECKING:  # the pool holds torch tensors
    from pagedkv.engine.kv.swap_pool import HostSwapPool


class StatsRecorder:
    """Samples the allocator after every step. Cheap: one ``stats()`` call per step.
    ``record_bytes``: one token's K and V over all layers (prices the prefix copies)."""

    tier_counts: TierCounts | None = None  # the runner's lower-tier copies (engine.py sets it)
    store_counters: StoreCounters | None = None  # the store tier's (engine.py sets it)

    def __init__(
        self, allocator: KVAllocator, swap_pool: HostSwapPool | None = None, record_bytes: int = 0
    ) -> None:
        self._allocator = allocator
        self._swap_pool = swap_pool
        self._record_bytes = record_bytes
        self._start: float | None = None
        self._last = 0.0
        self.num_steps = 0
        self.computed_tokens = 0
        self.generated_tokens = 0
        self.peak_used_blocks = 0
        self.peak_running = 0
        self._util_sum = 0.0
        self._util_peak = 0.0

    def record_step(self, batch: ScheduledBatch, started: float) -> None:
        """Sample the pool after the forward pass and before ``update`` frees the sequences that
        finish in this step (so peaks include them); ``started`` is the step's start time."""
        if self._start is None:
            self._start = started
        if batch.is_empty:
            return
        self.num_steps += 1
        for item in batch.seqs:
            self.generated_tokens += item.num_samples
            self.computed_tokens += item.num_new_tokens
        s = self._allocator.stats()
        self.peak_used_blocks = max(self.peak_used_blocks, s.num_used_blocks)
        self.peak_running = max(self.peak_running, len(batch.seqs))
        self._util_sum += s.kv_utilization
        self._util_peak = max(self._util_peak, s.kv_utilization)

    def end_step(self) -> None:
        self._last = time.perf_counter()

    def _store_items(self) -> tuple[tuple[str, int], ...]:
        c = self.store_counters
        return tuple(c.as_dict().items()) if c is not None else ()

    def snapshot(
        self, scheduler: Scheduler, num_unfinished_requests: int, num_failed_requests: int
    ) -> EngineSnapshot:
        """The engine's state now: the pool's stats, the queues and the run's counters."""
        kv = self._allocator.stats()
        return EngineSnapshot(
            num_total_blocks=kv.num_total_blocks,
            num_empty_blocks=kv.num_empty_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            kv_utilization=kv.kv_utilization,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            prefix_query_tokens=kv.prefix_query_tokens,
            num_running_seqs=scheduler.num_running,
            num_waiting_seqs=scheduler.num_waiting,
            peak_running_seqs=self.peak_running,
            num_preemptions=scheduler.num_preemptions,
            generated_tokens=self.generated_tokens,
            num_steps=self.num_steps,
            num_unfinished_requests=num_unfinished_requests,
            num_failed_requests=num_failed_requests,
            tier_hit_tokens=kv.tier_hit_tokens,
            tier_moves=self.tier_counts.copy() if self.tier_counts else None,
            kv_store=self._store_items(),
            **swap_counts(scheduler, self._swap_pool),
            num_partial_hits=kv.num_partial_hits,
            partial_hit_tokens=kv.partial_hit_tokens,
            prefix_copy_bytes=kv.partial_copied_tokens * self._record_bytes,
            num_partial_claims=kv.num_partial_claims,
        )

    def summary(self, scheduler: Scheduler) -> EngineStats:
        s = self._allocator.stats()
        return EngineStats(
            num_steps=self.num_steps,
            elapsed_s=(self._last - self._start) if self._start is not None else 0.0,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_query_tokens=s.prefix_query_tokens,
            peak_used_blocks=self.peak_used_blocks,
            total_blocks=s.num_total_blocks,
            kv_utilization_mean=self._util_sum / self.num_steps if self.num_steps else 0.0,
            kv_utilization_peak=self._util_peak,
            peak_running=self.peak_running,
            preemptions=scheduler.num_preemptions,
            tier_hit_tokens=s.tier_hit_tokens,
            kv_store=self._store_items(),
            swap_outs=scheduler.num_swap_outs,
            swap_ins=scheduler.num_swap_ins,
            swap_bytes=self._swap_pool.bytes_out + self._swap_pool.bytes_in
            if self._swap_pool
            else 0,
            partial_hits=s.num_partial_hits,
            partial_hit_tokens=s.partial_hit_tokens,
            prefix_copy_bytes=s.partial_copied_tokens * self._record_bytes,
            partial_claims=s.num_partial_claims,
        )


def swap_counts(scheduler: Scheduler, pool: HostSwapPool | None) -> dict[str, int]:
    """The swap counters of a snapshot (``EngineSnapshot``'s swap fields, all 0 under
    recompute): sequences and blocks as the scheduler ordered them, bytes as the pool copied."""
    return {
        "num_swap_outs": scheduler.num_swap_outs,
        "num_swap_ins": scheduler.num_swap_ins,
        "num_swapped_blocks_out": scheduler.num_swapped_blocks_out,
        "num_swapped_blocks_in": scheduler.num_swapped_blocks_in,
        "num_swap_fallbacks": scheduler.num_swap_fallbacks,
        "swap_out_bytes": pool.bytes_out if pool else 0,
        "swap_in_bytes": pool.bytes_in if pool else 0,
    }
