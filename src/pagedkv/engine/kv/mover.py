"""``KVMover``: every KV copy of a step, executed around the forward pass.

The scheduler and the allocator decide what moves (``sched/batch.py`` lists a step's orders;
``kvcache/tiers/`` holds the lower tiers' side); this class executes it on tensors, in the one
order that keeps each kind of copy a single batched gather/scatter:

``before_forward``
    1. **offloads** (device -> the tier that accepts them, the host tier): first, because the
       same step hands the evicted blocks to someone else;
    2. **swaps** (``HostSwapPool.apply``: swap-outs, then swap-ins);
    3. **copy-on-write** copies (device -> device) of forked partial blocks, and the **prefix
       copies** of partial prefix hits (the first slots of a block into a fresh one);
    4. **loads** (a lower tier -> fresh device blocks), last before the forward, which reads them.
``after_forward``
    5. **saves** (write-through of the full blocks the forward computed, to the tiers that want
       them: the store).

Which tier takes offloads or saves is the tier's declaration (``KVTier.accepts_offloads``,
``KVTier.wants_saves``), read once in ``attach``; an executor only moves bytes. The mover counts
blocks and bytes per tier (``counts``). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from pagedkv.engine.kv.block_copy import copy_rows, copy_slot_prefixes
from pagedkv.engine.kv.swap_pool import HostSwapPool
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import KVTier, PrefixCopy
from pagedkv.kvcache.tiers.counts import TierCounts
from pagedkv.model.kv_pool import KVCache
from pagedkv.sched.batch import ScheduledBatch


class BlockCopyFn(Protocol):
    """A backend's ``copy_blocks`` (``AttentionBackend.copy_blocks``)."""

    def __call__(
        self,
        pool: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
    ) -> None: ...


@runtime_checkable
class TierExecutor(Protocol):
    """Moves the bytes of one lower tier. ``kv_caches`` is the device pool (every layer's K, V
    ``[num_blocks, block_size, kv_heads, head_dim]``); each call mutates one side only."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V of every layer): the unit of the bytes-moved counter."""
        ...

    def describe(self) -> str:
        """The tier's start-up line (no prefix)."""
        ...

    def load(
        self, kv_caches: list[KVCache], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        """Copy the claimed blocks ``hashes`` into ``device_blocks``. Must not fail: anything
        that can (a network read, a checksum) happened in the tier's ``match``."""
        ...


@runtime_checkable
class OffloadExecutor(TierExecutor, Protocol):
    """The executor of a tier that ``accepts_offloads``."""

    def offload(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """Copy device blocks into the tier under their hashes."""
        ...


@runtime_checkable
class SaveExecutor(TierExecutor, Protocol):
    """The executor of a tier that ``wants_saves``."""

    def save(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        """Write computed full blocks through to the tier."""
        ...


class KVMover:
    """The device pool's copies: swap (``swap_pool``, or None), copy-on-write, and the lower
    tiers ``attach``-ed at start-up. Mutates the pools and ``counts`` only."""

    def __init__(
        self,
        kv_caches: list[KVCache],
        swap_pool: HostSwapPool | None = None,
        copy_blocks: BlockCopyFn | None = None,
    ) -> None:
        """``copy_blocks(pool, src, dst[, num_tokens])``: the backend's op for the copy-on-write
        and prefix copies (one call per pool tensor); None = ``copy_rows`` and
        ``copy_slot_prefixes``."""
        self.kv_caches = kv_caches
        self.swap_pool = swap_pool
        self.copy_blocks = copy_blocks
        self.counts = TierCounts()
        self._executors: dict[str, TierExecutor] = {}
        self._offload: tuple[str, OffloadExecutor] | None = None
        self._saves: list[tuple[str, SaveExecutor]] = []

    @property
    def has_tiers(self) -> bool:
        return bool(self._executors)

    def executor(self, name: str) -> TierExecutor | None:
        """The executor attached for tier ``name``, or None."""
        return self._executors.get(name)

    def attach(self, tier: KVTier, executor: TierExecutor) -> None:
        """Add the executor of ``tier`` (``ValueError`` when it cannot do what the tier
        declares, or a second tier accepts offloads: the allocator offers to one only)."""
        if tier.name in self._executors:
            raise ValueError(f"tier {tier.name!r} is attached already")
        if tier.accepts_offloads:
            if not isinstance(executor, OffloadExecutor) or self._offload is not None:
                raise ValueError(f"tier {tier.name!r} accepts offloads: one executor with offload")
            self._offload = (tier.name, executor)
        if tier.wants_saves:
            if not isinstance(executor, SaveExecutor):
                raise ValueError(f"tier {tier.name!r} wants saves: its executor has no save")
            self._saves.append((tier.name, executor))
        self._executors[tier.name] = executor

    def before_forward(self, batch: ScheduledBatch) -> None:
        """Steps 1-4 of the module docstring, for ``batch``."""
        kv = self.kv_caches
        if batch.block_offloads:
            if self._offload is None:
                raise RuntimeError("the batch offloads KV blocks but no tier accepts them")
            name, executor = self._offload
            blocks, hashes = zip(*batch.block_offloads, strict=True)
            executor.offload(kv, blocks, hashes)
            self.counts.add(name, "offloaded", len(blocks), executor.block_bytes)
        if self.swap_pool is not None:
            self.swap_pool.apply(batch, kv)
        elif batch.swap_out or batch.swap_in:
            raise RuntimeError("the batch swaps KV blocks but this runner has no host swap pool")
        if batch.block_copies:
            srcs, dsts = zip(*batch.block_copies, strict=True)
            if self.copy_blocks is None:
                copy_rows(kv, dsts, kv, srcs)
            else:
                device = kv[0][0].device
                src = torch.tensor(srcs, dtype=torch.int64).to(device, non_blocking=True)
                dst = torch.tensor(dsts, dtype=torch.int64).to(device, non_blocking=True)
                for pair in kv:
                    for pool in pair:
                        self.copy_blocks(pool, src, dst)
        if batch.prefix_copies:
            self._copy_prefixes(batch.prefix_copies)
        by_tier: dict[str, tuple[list[BlockHash], list[int]]] = {}
        for tier, block_hash, device_block in batch.block_loads:
            hashes, blocks = by_tier.setdefault(tier, ([], []))
            hashes.append(block_hash)
            blocks.append(device_block)
        for tier, (hashes, blocks) in by_tier.items():
            executor = self._executors[tier]
            executor.load(kv, hashes, blocks)
            self.counts.add(tier, "loaded", len(blocks), executor.block_bytes)

    def _copy_prefixes(self, copies: Sequence[PrefixCopy]) -> None:
        """The partial prefix hits' copies, through the backend's block copy when it has one."""
        kv = self.kv_caches
        if self.copy_blocks is None:
            copy_slot_prefixes(kv, copies)
            return
        device = kv[0][0].device
        src, dst, counts = (
            torch.tensor(column, dtype=torch.int64).to(device, non_blocking=True)
            for column in zip(*copies, strict=True)
        )
        for pair in kv:
            for pool in pair:
                self.copy_blocks(pool, src, dst, counts)

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Step 5: write-through of the step's computed full blocks to every saving tier."""
        if not batch.block_saves:
            return
        blocks, hashes = zip(*batch.block_saves, strict=True)
        for name, executor in self._saves:
            executor.save(self.kv_caches, blocks, hashes)
            self.counts.add(name, "saved", len(blocks), executor.block_bytes)
