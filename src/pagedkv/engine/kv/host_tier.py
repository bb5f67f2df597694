"""``HostKVTier``: the host tier's bytes -- evicted prefix blocks kept in host memory.

The facts (which hash is in which host slot, LRU order, per-step pins) live in
``kvcache/tiers/host_index.py``; this class owns the tensors (a ``HostPool``, the device pool's
block layout in host memory). A step's offloads (device -> host) and loads
(host -> device) each move together (``block_copy.copy_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.kv.block_copy import copy_rows
from pagedkv.engine.kv.host_pool import HostPool
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import TIER_HOST
from pagedkv.kvcache.tiers.host_index import HostTierIndex
from pagedkv.model.kv_pool import KVCache
from pagedkv.pages.page_format import PageFormat


class HostKVTier(HostPool):
    """The executor of the ``"host"`` tier (``mover.OffloadExecutor``): ``index`` is the
    ``KVTier`` the allocator holds (which declares that the host tier takes offloads), the
    ``HostPool`` its ``index.num_blocks`` slots."""

    name = TIER_HOST

    def __init__(
        self, index: HostTierIndex, page: PageFormat, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(page, index.num_blocks, device)
        self.index = index

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
