"""``HostKVTier``: the host tier's bytes -- evicted prefix blocks kept in host memory.

The facts (which hash is in which host slot, LRU order, per-step pins) live in
``kvcache/tiers/host_index.py``; this class owns the tensors: per layer, K and V of shape
``[num_host_blocks, block_size, num_kv_heads, head_dim]``, the device pool's block layout, so a
block moves as one row of each tensor. A step's offloads (device -> host) and loads
(host -> device) each move together (``copy_rows``): as a few slice copies per layer and tensor
when the blocks form long runs of consecutive ids on both sides (the usual case: a prompt's
blocks are evicted and taken in order), else as one ``index_select`` + ``index_copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import TIER_HOST
from pagedkv.kvcache.tiers.host_index import HostTierIndex
from pagedkv.model.kv_pool import KVCache, allocate_host_kv_caches, pool_layout


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


# Slice copies pay off when the average run is at least this long (fewer, bigger memcpys and no
# temporary); shorter runs go through one gather/scatter per tensor.
_MIN_MEAN_RUN = 4


def copy_rows(
    dst: list[KVCache], dst_rows: Sequence[int], src: list[KVCache], src_rows: Sequence[int]
) -> None:
    """``dst[l][t][dst_rows[i]] = src[l][t][src_rows[i]]`` for every layer ``l``, tensor
    ``t`` (K, V) and ``i``. Destination rows must be distinct; sources must not be written
    by the same call. Mutates ``dst`` only."""
    runs: list[list[int]] = []  # [dst start, src start, length], by destination
    for d, s in sorted(zip(dst_rows, src_rows, strict=True)):
        last = runs[-1] if runs else None
        if last is not None and d == last[0] + last[2] and s == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([d, s, 1])
    if len(runs) * _MIN_MEAN_RUN <= len(dst_rows):
        for dst_pair, src_pair in zip(dst, src, strict=True):
            for to, frm in zip(dst_pair, src_pair, strict=True):
                for d, s, n in runs:
                    to[d : d + n].copy_(frm[s : s + n])
        return
    d_idx = torch.tensor(dst_rows, dtype=torch.int64)
    s_idx = torch.tensor(src_rows, dtype=torch.int64)
    for dst_pair, src_pair in zip(dst, src, strict=True):
        for to, frm in zip(dst_pair, src_pair, strict=True):
            to.index_copy_(0, d_idx, frm.index_select(0, s_idx))
