"""The start-up lines the engine prints once (``startup.build_parts`` adds each section's own):
the policy, the block size and the reason for every rewrite, the pool in usable blocks, the
host swap pool."""

from __future__ import annotations

from pagedkv.engine.runner import ModelRunner
from pagedkv.kvcache.policies import Policy
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.pages.layout import KVLayout
from pagedkv.planner.constraints import BlockSizeResolution


def startup_report(
    policy: Policy,
    resolution: BlockSizeResolution,
    allocator: KVAllocator,
    runner: ModelRunner,
    layout: KVLayout,
    max_model_len: int,
) -> list[str]:
    """The start-up lines. The pool is counted in *usable* blocks, the allocator's own count,
    which every snapshot, metric and refusal message uses too; blocks the runner holds beyond
    them (the null block that pads block tables) are named apart."""
    usable, size = allocator.num_total_blocks, allocator.block_size
    num_null = runner.num_blocks - usable
    null = f" (+{num_null} null block)" if num_null == 1 else f" (+{num_null} null blocks)"
    preset_size = policy.block_size
    overridden = policy.allocator != "reserved" and preset_size not in (None, size)
    override = f"; its block size {preset_size} replaced by {size}" if overridden else ""
    unit = policy.prefix_match_unit
    if unit is not None and unit < size:
        override += f"; prefix matches in units of {unit} tokens (partial blocks reused)"
    return [
        f"policy {policy.name} ({policy.description}{override})",
        resolution.log_line(),
        f"KV pool {usable} usable blocks x {size} tokens = {usable * size} slots"
        f"{null if num_null else ''}, {runner.kv_cache_bytes / 2**20:.1f} MiB "
        f"({layout.record_bytes} bytes per token"
        f"{'' if runner.page.tp_size == 1 else ', each rank its KV heads'}); "
        f"max_model_len {max_model_len}",
        *swap_report_lines(runner),
    ]


def swap_report_lines(runner: ModelRunner) -> list[str]:
    """The host swap pool's line, when swap preemption is on."""
    pool = runner.swap_pool
    if pool is None:
        return []
    return [
        f"host swap pool {pool.num_blocks} blocks x {pool.block_size} tokens = "
        f"{pool.num_blocks * pool.block_size} slots, {pool.pool_bytes / 2**20:.1f} MiB in host "
        "memory (preemption swaps KV out, recompute when it is full)"
    ]
