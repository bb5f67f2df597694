"""``HostKVTier``: the host tier's bytes -- evicted prefix blocks kept in host memory.

The facts (which hash is in which host slot, LRU order, per-step pins) live in
``kvcache/tiers/host_index.py``; this class owns the tensors: per layer, K and V of shape
``[num_host_blocks, block_size, num_kv_heads, head_dim]``, the device pool's block layout, so a
block moves as one row of each tensor. A step's offloads (device -> host) and loads
(host -> device) each move together (``block_copy.copy_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.kv.block_copy import copy_rows
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import TIER_HOST
from pagedkv.kvcache.tiers.host_index import HostTierIndex
from pagedkv.model.kv_pool import KVCache, allocate_host_kv_caches, pool_layout


class HostKVTier:
    """The executor of the ``"host"`` tier (``mover.OffloadExecutor``); ``index`` is the
    ``KVTier`` the allocator holds (it declares that the host tier takes offloads). Slots are only read after an offload wrote them, so the pool
    is left uninitialised (``torch.empty``: committed page by page as offloads touch it)."""

    name = TIER_HOST

    def __init__(
        self,
        index: HostTierIndex,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.index = index
        self.block_size = block_size  # tokens per block
        self.kv_caches: list[KVCache] = allocate_host_kv_caches(
            num_layers, index.num_blocks, block_size, num_kv_heads, head_dim, dtype
        )
        self.block_bytes = pool_layout(self.kv_caches).block_bytes(block_size)

    @property
    def num_blocks(self) -> int:
        return self.index.num_blocks

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def offload(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        slots = [self.index.slot_of(h) for h in hashes]
        copy_rows(self.kv_caches, slots, kv_caches, device_blocks)

    def load(
        self, kv_caches: list[KVCache], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        slots = [self.index.slot_of(h) for h in hashes]
        copy_rows(kv_caches, device_blocks, self.kv_caches, slots)

    def describe(self) -> str:
        """The start-up line's text."""
        return (
            f"host KV tier {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_blocks * self.block_size} slots, {self.pool_bytes / 2**20:.1f} MiB in "
            "host memory (evicted prefix blocks, LRU; a hit is copied back, not recomputed)"
        )
