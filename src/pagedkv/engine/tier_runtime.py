"""``TierRuntime``: the engine's side of the lower KV tiers (the bytes; ``kvcache/tiers/contract.py`` has
the contract and the allocator decides what moves).

Each lower tier has an executor here, found by the tier's name. In a step the runner calls
``offload`` first (evicted device blocks copied into the host tier, before anything writes the
device pool), ``load`` just before the forward pass (blocks copied from their tier into fresh
device blocks) and ``save`` after it (write-through of the full blocks the forward computed).
Each call hands an executor all of the step's blocks of one kind at once, so that it can move
them with one gather/scatter per layer. The runtime counts blocks and bytes per tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedkv.kvcache.tiers.counts import TierCounts
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.model.kv_pool import KVCache
from pagedkv.sched.batch import ScheduledBatch


class TierExecutor(Protocol):
    """Moves the bytes of one lower tier. ``kv_caches`` is the device pool (every layer's K, V
    ``[num_blocks, block_size, kv_heads, head_dim]``); each call mutates one side only."""

    @property
    def name(self) -> str: ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V of every layer): the unit of the bytes-moved counter."""
        ...

    def offload(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """Copy device blocks into the tier under their hashes (tiers that accept offloads)."""
        ...

    def load(
        self, kv_caches: list[KVCache], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        """Copy the claimed blocks ``hashes`` into ``device_blocks``. Must not fail: anything
        that can (a network read, a checksum) happened in the tier's ``match``."""
        ...

    def save(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """Write computed full blocks through to the tier (tiers that want saves)."""
        ...


class TierRuntime:
    """The executors of an engine's lower tiers, by name. Engine thread only."""

    def __init__(self, executors: Sequence[TierExecutor]) -> None:
        self.executors = {e.name: e for e in executors}
        self.counts = TierCounts()

    def offload(self, batch: ScheduledBatch, kv_caches: list[KVCache]) -> None:
        """Step part 0: the offload orders (to the one tier that accepts them)."""
        if not batch.block_offloads:
            return
        blocks, hashes = zip(*batch.block_offloads, strict=True)
        # The allocator offers evictions to one tier only: the host tier.
        executor = next(e for e in self.executors.values() if _accepts_offloads(e))
        executor.offload(kv_caches, blocks, hashes)
        self.counts.add(executor.name, "offloaded", len(blocks), executor.block_bytes)

    def load(self, batch: ScheduledBatch, kv_caches: list[KVCache]) -> None:
        """Step part 4: the loads, one call per tier."""
        by_tier: dict[str, tuple[list[BlockHash], list[int]]] = {}
        for tier, block_hash, device_block in batch.block_loads:
            hashes, blocks = by_tier.setdefault(tier, ([], []))
            hashes.append(block_hash)
            blocks.append(device_block)
        for tier, (hashes, blocks) in by_tier.items():
            executor = self.executors[tier]
            executor.load(kv_caches, hashes, blocks)
            self.counts.add(tier, "loaded", len(blocks), executor.block_bytes)

    def save(self, batch: ScheduledBatch, kv_caches: list[KVCache]) -> None:
        """After the forward pass: write-through to every tier that wants saves."""
        if not batch.block_saves:
            return
        blocks, hashes = zip(*batch.block_saves, strict=True)
        for executor in self.executors.values():
            if getattr(executor, "wants_saves", False):
                executor.save(kv_caches, blocks, hashes)
                self.counts.add(executor.name, "saved", len(blocks), executor.block_bytes)


def _accepts_offloads(executor: TierExecutor) -> bool:
    return bool(getattr(executor, "accepts_offloads", False))
