"""The host swap pool: where swap preemption parks a sequence's KV blocks while it waits.

The scheduler decides (``sched/scheduler.py``, ``kvcache/tiers/swap_space.py``): a step's
``ScheduledBatch.swap_out`` lists ``(device_block, host_block)`` copies and ``swap_in``
``(host_block, device_block)`` copies. ``HostSwapPool`` executes them on its ``HostPool``
(``host_pool.py``: the device pool's block layout in host memory).

Every step's copies of one direction move together (``block_copy.copy_rows``: slice copies
for long runs, else one gather and one scatter per layer and tensor), never a Python loop per
block. ``apply`` runs swap-outs before swap-ins (the batch's order): a device block
freed by a swap-out may be reused in the same step, so it must be read first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.kv.block_copy import copy_rows
from pagedkv.engine.kv.host_pool import HostPool
from pagedkv.model.kv_pool import KVCache
from pagedkv.pages.page_format import PageFormat
from pagedkv.sched.batch import ScheduledBatch


class HostSwapPool(HostPool):
    """The swap pool's blocks and the blocks moved so far. Not thread-safe: the engine thread
    only."""

    def __init__(
        self, page: PageFormat, num_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(page, num_blocks, device)
        self.blocks_out = 0  # device -> host, counted as copied
        self.blocks_in = 0  # host -> device
        self._last_step: int | None = None  # the last step whose swaps ``apply`` ran

    @property
    def bytes_out(self) -> int:
        return self.blocks_out * self.block_bytes

    @property
    def bytes_in(self) -> int:
        return self.blocks_in * self.block_bytes

    def apply(self, batch: ScheduledBatch, device_caches: list[KVCache]) -> None:
        """Execute ``batch.swap_out`` then ``batch.swap_in`` on ``device_caches``, at most once
        per step: a second call for the same ``batch.step`` (containment re-running entries of
        a failed step one by one) moves nothing, as the blocks already moved. Call it before
        the step's block copies and forward pass. Mutates both pools and the counters."""
        if batch.step == self._last_step or not (batch.swap_out or batch.swap_in):
            return
        self._last_step = batch.step  # before copying: a copy that raises is not retried
        if batch.swap_out:
            self.swap_out(device_caches, batch.swap_out)
        if batch.swap_in:
            self.swap_in(device_caches, batch.swap_in)

    def swap_out(
        self, device_caches: list[KVCache], device_host: Sequence[tuple[int, int]]
    ) -> None:
        """Copy device blocks to host blocks, ``(device, host)`` pairs. Host blocks must be
        distinct; a device block may appear twice (two sequences sharing a prefix block each
        park their own copy)."""
        if not device_host:
            return
        src, dst = zip(*device_host, strict=True)
        copy_rows(self.kv_caches, dst, device_caches, src)
        self.blocks_out += len(device_host)

    def swap_in(self, device_caches: list[KVCache], host_device: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, ``(host, device)`` pairs; the device blocks must
        be distinct (fresh blocks of the sequences coming back)."""
        if not host_device:
            return
        src, dst = zip(*host_device, strict=True)
        copy_rows(device_caches, dst, self.kv_caches, src)
        self.blocks_in += len(host_device)
