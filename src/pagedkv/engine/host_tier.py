"""``HostKVTier``: the host tier's bytes -- evicted prefix blocks kept in host memory.

The facts (which hash is in which host slot, LRU order, per-step pins) live in
``kvcache/host_index.py``; this class owns the tensors: per layer, K and V of shape
``[num_host_blocks, block_size, num_kv_heads, head_dim]``, the device pool's block layout, so a
block moves as one row of each tensor. A step's offloads (device -> host) and loads
(host -> device) each move as one ``index_select`` + ``index_copy_`` per layer and tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.host_index import HostTierIndex
from pagedkv.kvcache.tiers import TIER_HOST
from pagedkv.model.kv_pool import KVCache


class HostKVTier:
    """The executor of the ``"host"`` tier (``engine/tier_runtime.py``); ``index`` is the
    ``KVTier`` the allocator holds. Slots are only read after an offload wrote them, so the pool
    is left uninitialised (``torch.empty``: committed page by page as offloads touch it)."""

    name = TIER_HOST
    accepts_offloads = True
    wants_saves = False

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
        shape = (index.num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches: list[KVCache] = [
            (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
            for _ in range(num_layers)
        ]
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_blocks(self) -> int:
        return self.index.num_blocks

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def _slots(self, hashes: Sequence[BlockHash]) -> torch.Tensor:
        slot_of = self.index.slot_of
        return torch.tensor([slot_of(h) for h in hashes], dtype=torch.int64)

    def offload(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        src = torch.tensor(device_blocks, dtype=torch.int64)
        dst = self._slots(hashes)
        for (k, v), (hk, hv) in zip(kv_caches, self.kv_caches, strict=True):
            hk.index_copy_(0, dst, k.index_select(0, src))
            hv.index_copy_(0, dst, v.index_select(0, src))

    def load(
        self, kv_caches: list[KVCache], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        src = self._slots(hashes)
        dst = torch.tensor(device_blocks, dtype=torch.int64)
        for (k, v), (hk, hv) in zip(kv_caches, self.kv_caches, strict=True):
            k.index_copy_(0, dst, hk.index_select(0, src))
            v.index_copy_(0, dst, hv.index_select(0, src))

    def save(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        raise RuntimeError("the host tier is filled by offloads, not write-through saves")

    def describe(self) -> str:
        """The start-up line's text."""
        return (
            f"host KV tier {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_blocks * self.block_size} slots, {self.pool_bytes / 2**20:.1f} MiB in "
            "host memory (evicted prefix blocks, LRU; a hit is copied back, not recomputed)"
        )
