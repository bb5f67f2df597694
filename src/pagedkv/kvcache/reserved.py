"""``ReservedAllocator``: the contiguous baseline that paging replaces.

Each admitted sequence reserves one contiguous region of ``max_model_len`` slots, whatever its
real length, and keeps it until it is freed: the "reserve the maximum" policy of the second
article. Regions are handed out first fit (lowest free region). Admission is refused when no
whole region is free, however many slots sit unused inside the reserved ones. No sharing, so no
prefix hits; a fork copies the whole region.

To reuse the block-table machinery a region is one "block" of ``max_model_len`` slots, so the
engine drives this allocator through the same slot mapping and block tables as the others
(a block table of exactly one entry). There is no null region: with one block per sequence the
padding of the exported table is never read.
"""

from __future__ import annotations

import heapq

from pagedkv.kvcache.allocator_base import BlockTableAllocator, SeqBlocks
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike


class ReservedAllocator(BlockTableAllocator):
    """``num_slots // max_model_len`` regions of ``max_model_len`` slots each."""

    def __init__(self, num_slots: int, max_model_len: int) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
        if not isinstance(num_slots, int) or num_slots < max_model_len:
            raise ValueError(
                f"num_slots={num_slots!r} cannot hold one region of max_model_len={max_model_len}"
            )
        super().__init__(max_model_len)
        self.num_slots = num_slots
        self._num_regions = num_slots // max_model_len
        self._free_regions = list(range(self._num_regions))  # a heap: first fit = lowest id

    @property
    def max_model_len(self) -> int:
        return self._block_size

    @property
    def block_size(self) -> int:
        """``max_model_len``: a region is this allocator's one block. The protocol needs it
        under this name because every consumer computes slots as
        ``block_table[i // block_size] * block_size + i % block_size``; with a one-entry table
        that is ``region * max_model_len + i``, the region's own slots."""
        return self._block_size

    @property
    def num_total_blocks(self) -> int:
        return self._num_regions

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free_regions)

    def match_prefix(self, seq: SeqLike) -> int:
        return 0  # nothing is shared between reserved regions

    def allocate(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        self._check_count("num_new_tokens", num_new_tokens)
        if num_cached_tokens:
            raise ValueError("the reserved allocator shares nothing: num_cached_tokens must be 0")
        st = self._seqs.get(seq.seq_id)
        total = num_new_tokens + (st.num_tokens if st is not None else 0)
        self._check_known_tokens(seq, total)
        if total > self._block_size:
            return False  # past its region: can never grow there
        if st is not None:
            st.num_tokens = total
            return True
        self._check_new(seq)
        if not self._free_regions:
            return False
        region = heapq.heappop(self._free_regions)
        self._seqs[seq.seq_id] = SeqBlocks([region], total)
        self._prefix.query_tokens += len(seq.token_ids)
        return True

    def tokens_known(self, seq: SeqLike) -> None:
        """No prefix cache: nothing to enter."""

    def free(self, seq: SeqLike, preempted: bool = False) -> None:
        st = self._pop(seq, preempted)
        heapq.heappush(self._free_regions, st.block_ids[0])

    def fork(self, parent: SeqLike, child: SeqLike) -> list[tuple[int, int]] | None:
        st = self._check_fork(parent, child)
        if not self._free_regions:
            return None
        region = heapq.heappop(self._free_regions)
        self._seqs[child.seq_id] = SeqBlocks([region], st.num_tokens)
        return [(st.block_ids[0], region)]

    def stats(self) -> KVCacheStats:
        return self._make_stats(self._num_regions, len(self._free_regions), 0, 0, reserved=True)

    def check_invariants(self) -> None:
        held = [st.block_ids[0] for st in self._seqs.values()]
        assert all(len(st.block_ids) == 1 for st in self._seqs.values()), "one region per seq"
        assert len(set(held)) == len(held), "a region is held by two sequences"
        assert not set(held) & set(self._free_regions), "a held region is also free"
        assert len(held) + len(self._free_regions) == self._num_regions, "a region went missing"
        assert all(0 <= r < self._num_regions for r in held + self._free_regions)
        for sid, st in self._seqs.items():
            assert 0 < st.num_tokens <= self._block_size or st.num_tokens == 0, f"seq {sid}"
