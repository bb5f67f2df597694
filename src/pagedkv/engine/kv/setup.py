"""Start-up of the lower KV tiers: size the host tier from ``--host-kv-memory``, hand the tiers
to the allocator (``PagedAllocator.set_tiers``) and their executors to the runner's ``KVMover``.

Tiers are in lookup order: the host tier first (cheapest to read), then any further tier (a
shared store) its builder passes in ``extra``. No tier configured = nothing changes: the
allocator and the runner behave exactly as without this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv.host_tier import HostKVTier
from pagedkv.engine.kv.mover import TierExecutor
from pagedkv.engine.runner import ModelRunner
from pagedkv.errors import UsageError
from pagedkv.kvcache.paged import PagedAllocator
from pagedkv.kvcache.policies import Policy
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.kvcache.tiers.contract import KVTier
from pagedkv.kvcache.tiers.host_index import HostTierIndex
from pagedkv.pages.layout import KVLayout

PARAM = "host_kv_memory"


def host_tier_blocks(
    config: EngineConfig, policy: Policy, layout: KVLayout, block_size: int
) -> int:
    """Host blocks ``--host-kv-memory`` buys (0 = off). ``UsageError`` (one line) when the
    policy cannot use a host tier or the size holds no block. Before the weights load."""
    size = config.host_kv_memory_bytes
    if not size:
        return 0
    if policy.allocator != "paged" or not policy.prefix_caching:
        raise UsageError(
            f"--host-kv-memory needs a paged policy with a prefix cache (vllm, trtllm, paged:B); "
            f"{policy.name} has none keyed by block hash",
            param=PARAM,
        )
    block_bytes = layout.block_bytes(block_size)
    if size < block_bytes:
        raise UsageError(
            f"--host-kv-memory of {size} bytes holds no KV block of {block_size} tokens "
            f"({block_bytes} bytes each): give {block_bytes} bytes or more, or 0 for none",
            param=PARAM,
        )
    return size // block_bytes


def attach_tiers(
    allocator: KVAllocator,
    runner: ModelRunner,
    num_host_blocks: int,
    extra: Sequence[tuple[KVTier, TierExecutor]] = (),
) -> list[str]:
    """Build the host tier (``num_host_blocks`` > 0), give the allocator every tier and the
    runner every executor; returns the start-up lines (without the ``pagedkv:`` prefix)."""
    tiers: list[tuple[KVTier, TierExecutor]] = []
    if num_host_blocks:
        # Pinned host memory when the pool is on a GPU.
        host = HostKVTier(HostTierIndex(num_host_blocks), runner.page, runner.device)
        tiers.append((host.index, host))
    tiers.extend(extra)
    if not tiers:
        return []
    if not isinstance(allocator, PagedAllocator):
        raise UsageError("lower KV tiers need a paged policy with a prefix cache", param=PARAM)
    allocator.set_tiers([t for t, _ in tiers])
    for tier, executor in tiers:
        runner.mover.attach(tier, executor)
    return [e.describe() for _, e in tiers]
