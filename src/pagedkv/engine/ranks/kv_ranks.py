"""KV blocks that cross the ranks: the store's bodies, and the host tier's slots on the workers.

The store (``kvstore/``) keeps *whole* blocks: every KV head of the model, in the layout one
rank holds at ``tp_size`` 1 (``block_copy.py``: per layer K then V, ``[block_size, heads,
head_dim]``), under the namespace of the whole page format. So an engine of any size reads what
any other wrote, and a P/D pair of different sizes moves KV by head slices:

* a save gathers each rank's slice of the step's blocks onto rank 0 (host bytes, the gloo
  group), which joins them on the head axis (one copy of each KV head: replicated heads are
  taken from their first rank) and hands the whole bodies to the store's writer;
* a load splits each whole body rank 0's tier verified into the ranks' head slices and scatters
  them; every rank writes its slice into the same device blocks. Rank 0 holds the bodies until
  the scatter returns, when every rank has its slice.

The workers' host tier keeps the same slots as rank 0's (its index decides; ``FollowedIndex``
reads the step's slots from the step's message).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedkv.engine.kv.block_copy import read_blocks, write_blocks
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import TIER_STORE
from pagedkv.kvstore.tier import StoreTier
from pagedkv.model.kv_pool import KVCache, torch_kv_dtype
from pagedkv.model.parallel import TPGroup
from pagedkv.pages.head_split import HeadSplit
from pagedkv.pages.page_format import PageFormat


class TierRole(NamedTuple):
    """What a worker's mover needs of a tier it only follows (``KVMover.attach``)."""

    name: str
    accepts_offloads: bool
    wants_saves: bool


class FollowedIndex:
    """A worker's host tier index: rank 0's slots for this step's hashes (``slots``, set from
    each ``StepMessage``)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.slots: dict[BlockHash, int] = {}

    def slot_of(self, block_hash: BlockHash) -> int:
        return self.slots[block_hash]


class HeadSlices:
    """Whole block bodies <-> each rank's head slices, for pages of ``page`` (a rank's format)
    split by ``split``."""

    def __init__(self, page: PageFormat, split: HeadSplit) -> None:
        self.page, self.split = page, split
        self.dtype = torch_kv_dtype(page)
        self.rank_bytes = page.record_bytes * page.block_size  # one block of one rank
        self.whole_bytes = page.whole().record_bytes * page.block_size

    def _shape(self, n: int, heads: int) -> tuple[int, ...]:
        p = self.page
        return (n, p.num_layers, 2, p.block_size, heads, p.head_dim)

    def join(self, parts: list[torch.Tensor], n: int) -> torch.Tensor:
        """``n`` whole bodies ``[n, whole_bytes]`` from every rank's ``[n * rank_bytes]``."""
        heads = self.page.num_kv_heads
        owned = [parts[r].view(self.dtype).view(self._shape(n, heads)) for r in self.split.owners()]
        return torch.cat(owned, dim=4).reshape(n, -1).view(torch.uint8)

    def split_out(self, whole: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Each rank's ``[n * rank_bytes]`` slice of ``n`` whole bodies ``[n, whole_bytes]``."""
        model_heads = self.page.model_kv_heads
        blocks = whole.view(self.dtype).view(self._shape(n, model_heads))
        out = []
        for rank in range(self.split.tp_size):
            heads = self.split.kv_heads(rank)
            part = blocks.narrow(4, heads.start, len(heads)).contiguous()
            out.append(part.view(-1).view(torch.uint8))
        return out


class RankedStore:
    """The store tier's executor on every rank (``mover.SaveExecutor``): ``tier`` on rank 0
    (None on the workers, which never talk to the store). Counts whole blocks."""

    name = TIER_STORE

    def __init__(self, group: TPGroup, slices: HeadSlices, tier: StoreTier | None) -> None:
        self.group, self.slices, self.tier = group, slices, tier
        self.block_bytes = slices.whole_bytes

    def load(
        self, kv_caches: list[KVCache], hashes: Sequence[BlockHash], device_blocks: Sequence[int]
    ) -> None:
        n, size = len(device_blocks), self.slices.rank_bytes
        parts = None
        if self.tier is not None:  # rank 0: the bodies its tier verified, split by heads
            bodies = self.tier.take(hashes)
            whole = torch.frombuffer(bytearray(b"".join(bodies)), dtype=torch.uint8)
            parts = self.slices.split_out(whole.view(n, -1), n)
        mine = memoryview(self.group.scatter_bytes(parts, n * size).numpy())  # host: gloo's bytes
        write_blocks(kv_caches, device_blocks, [mine[i * size : (i + 1) * size] for i in range(n)])

    def save(
        self, kv_caches: list[KVCache], device_blocks: Sequence[int], hashes: Sequence[BlockHash]
    ) -> None:
        bodies = read_blocks(kv_caches, device_blocks)  # host copies: the blocks may be reused
        mine = torch.frombuffer(bytearray(b"".join(bodies)), dtype=torch.uint8)
        parts = self.group.gather_bytes(mine)
        if parts is None or self.tier is None:
            return
        whole = self.slices.join(parts, len(device_blocks)).numpy()  # host: gathered bytes
        items = [(h, memoryview(whole[i])) for i, h in enumerate(hashes)]
        self.tier.submit(items)

    def describe(self) -> str:
        if self.tier is None:
            return "KV store tier (rank 0's)"
        state = "NOT answering (recomputing until it does)" if self.tier.client.is_down else "up"
        return (
            f"{self.tier.describe()}; {state}; whole blocks, joined from and split to "
            f"{self.group.size} ranks' KV heads"
        )
