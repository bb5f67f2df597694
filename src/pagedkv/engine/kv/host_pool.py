"""``HostPool``: KV blocks in host memory, in the device pool's layout (one class for both).

pagedkv keeps two host pools with two budgets, on purpose: the swap pool (``--swap-space``)
parks whole preempted sequences until they come back, and must hold them or swap preemption
recomputes; the host tier (``--host-kv-memory``) is an LRU cache of evicted prefix blocks that
may drop any block. Both are this class underneath: per layer, K and V of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` (a block moves as one row of each tensor,
``block_copy.copy_rows``), left uninitialised (``torch.empty``: a block is only read after a copy
wrote it, so the memory is committed page by page as copies touch it), pinned when the device
pool is on a GPU (faster transfers).
"""

from __future__ import annotations

import torch

from pagedkv.model.kv_pool import KVCache, allocate_host_kv_caches
from pagedkv.pages.page_format import PageFormat


class HostPool:
    """``num_blocks`` host blocks; the sizes the stats and start-up lines report."""

    def __init__(
        self, page: PageFormat, num_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        """``page``: the device pool's page format; ``device``: where the device pool lives
        (pinned host memory for a GPU)."""
        if num_blocks < 1:
            raise ValueError(f"a host KV pool needs num_blocks >= 1, got {num_blocks}")
        pin = torch.device(device).type == "cuda"
        self.kv_caches: list[KVCache] = allocate_host_kv_caches(page, num_blocks, pin_memory=pin)
        self.num_blocks = num_blocks
        self.block_size = page.block_size  # tokens per block
        self.block_bytes = page.record_bytes * page.block_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole host pool (K and V of every layer)."""
        return self.num_blocks * self.block_bytes
