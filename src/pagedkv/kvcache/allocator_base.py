"""The allocator base class: per-sequence block tables and what every allocator derives from them.

``BlockTableAllocator`` is the shared half of the three allocators: it owns the map from
sequence id to ``SeqBlocks`` (block table + number of tokens with slots) and turns it into slot
mappings, padded int32 block tables and the slot-level statistics. The subclasses decide where
blocks come from (a block pool with a hash index, a radix tree, contiguous regions).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.kvcache.block_pool import NULL_BLOCK_ID
from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike
from pagedkv.kvcache.tiers.contract import NO_TIER_ORDERS, KVTier, TierOrders

INT32_BYTES = 4


class SeqBlocks:
    """The blocks of one live sequence. ``block_ids[i]`` holds tokens ``[i*B, (i+1)*B)``;
    ``len(block_ids) == ceil(num_tokens / B)`` always."""

    __slots__ = ("block_ids", "num_tokens", "block_hashes", "tree_node", "tree_depth")

    def __init__(self, block_ids: list[int], num_tokens: int) -> None:
        self.block_ids = block_ids
        self.num_tokens = num_tokens
        self.block_hashes: list[BlockHash] = []  # paged: chain hashes of the full blocks
        self.tree_node: object | None = None  # radix: deepest tree node on this sequence's path
        self.tree_depth = 0  # radix: how many of block_ids are tree pages (a root path)


@dataclass
class PrefixCounters:
    """Running totals kept by every allocator (plain ints, mutated in place)."""

    query_tokens: int = 0
    hit_tokens: int = 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# How many finished sequence ids an allocator remembers to reject growing a freed sequence.
_RETIRED_MEMORY = 65_536


class BlockTableAllocator:
    """Shared bookkeeping; subclasses set ``_block_size`` and fill ``_seqs``."""

    _block_size: int

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._seqs: dict[int, SeqBlocks] = {}
        self._prefix = PrefixCounters()
        # Ids freed for good (not preempted): allocating for them again is a caller bug, not a
        # new admission. Bounded, so a long-running server does not grow without limit.
        self._retired: set[int] = set()
        self._retired_order: deque[int] = deque()

    @property
    def block_size(self) -> int:
        return self._block_size

    def drain_tier_orders(self) -> TierOrders:
        """The lower-tier copies this step ordered (``tiers/contract.py``), handed out once; the paged
        allocator with tiers overrides it. Called by the scheduler at the end of a step."""
        return NO_TIER_ORDERS

    def enable_events(self, log: KVEventLog) -> None:
        """Report the prefix cache's changes to ``log`` (``events.py``). An allocator without a
        prefix cache (reserved) reports only that it holds nothing."""
        log.cleared()

    def lower_tiers(self) -> tuple[KVTier, ...]:
        """The lower tiers in lookup order; none unless the paged allocator was given some."""
        return ()

    def prefix_hashes(self) -> set[BlockHash]:
        """The chained hashes of every block the prefix cache holds now (what replaying this
        allocator's KV events gives). O(cached blocks): for tests and snapshots."""
        return set()

    # -- argument checks shared by the subclasses ------------------------------------------

    def _state(self, seq: SeqLike) -> SeqBlocks:
        try:
            return self._seqs[seq.seq_id]
        except KeyError:
            raise ValueError(
                f"sequence {seq.seq_id} is not allocated here (never admitted, or already freed)"
            ) from None

    @staticmethod
    def _check_count(name: str, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")

    @staticmethod
    def _check_known_tokens(seq: SeqLike, total_tokens: int) -> None:
        if total_tokens > len(seq.token_ids):
            raise ValueError(
                f"sequence {seq.seq_id}: slots for {total_tokens} tokens requested but only "
                f"{len(seq.token_ids)} token ids are known (append tokens before allocating)"
            )

    def _check_new(self, seq: SeqLike) -> None:
        """Raise unless ``seq`` may be admitted: not live here, and not freed for good."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} is already allocated here")
        if seq.seq_id in self._retired:
            raise ValueError(
                f"sequence {seq.seq_id} was freed; growing a freed sequence is an error "
                "(free it with preempted=True if it is to be admitted again)"
            )

    def _check_fork(self, parent: SeqLike, child: SeqLike) -> SeqBlocks:
        """The parent's state, after checking that ``child`` may be forked from it: new here,
        starting with the parent's tokens, under the same extra keys."""
        st = self._state(parent)
        self._check_new(child)
        n = st.num_tokens
        if list(child.token_ids[:n]) != list(parent.token_ids[:n]):
            raise ValueError(f"fork: child {child.seq_id} does not start with the parent's tokens")
        if child.extra_keys != parent.extra_keys:
            raise ValueError("fork: child and parent must have the same extra keys")
        return st

    def _pop(self, seq: SeqLike, preempted: bool) -> SeqBlocks:
        """Remove ``seq``'s state; remember its id unless it will be re-admitted."""
        sid = seq.seq_id
        st = self._seqs.pop(sid, None)
        if st is None:
            return self._state(seq)  # raises: not allocated here
        if not preempted:
            self._retired.add(sid)
            order = self._retired_order
            order.append(sid)
            if len(order) > _RETIRED_MEMORY:
                self._retired.discard(order.popleft())
        return st

    # -- views -----------------------------------------------------------------------------

    def num_tokens(self, seq: SeqLike) -> int:
        return self._state(seq).num_tokens

    def block_table(self, seq: SeqLike) -> Sequence[int]:
        return self._state(seq).block_ids

    def has_seq(self, seq: SeqLike) -> bool:
        return seq.seq_id in self._seqs

    def slot_mapping(self, seq: SeqLike, start: int, end: int) -> list[int]:
        st = self._state(seq)
        if not 0 <= start <= end <= st.num_tokens:
            raise ValueError(
                f"slot range [{start}, {end}) outside the {st.num_tokens} allocated tokens"
            )
        bs, table = self._block_size, st.block_ids
        out: list[int] = []
        pos = start
        while pos < end:  # one range per block, not one Python step per token
            i, off = divmod(pos, bs)
            stop = min(end, (i + 1) * bs)
            base = table[i] * bs
            out.extend(range(base + off, base + off + stop - pos))
            pos = stop
        return out

    def block_tables(
        self, seqs: Sequence[SeqLike], max_blocks: int | None = None
    ) -> tuple[array, int]:
        tables = [self._state(s).block_ids for s in seqs]
        width = max((len(t) for t in tables), default=0) if max_blocks is None else max_blocks
        out = array("i")
        for t in tables:
            if len(t) > width:
                raise ValueError(f"a block table of {len(t)} blocks exceeds max_blocks={width}")
            out.extend(t)
            out.extend([NULL_BLOCK_ID] * (width - len(t)))
        return out, width

    # -- statistics --------------------------------------------------------------------------

    def _make_stats(
        self,
        num_total_blocks: int,
        num_empty_blocks: int,
        num_cached_blocks: int,
        num_evictions: int,
        reserved: bool = False,
    ) -> KVCacheStats:
        """The snapshot every allocator reports, from its block counts.

        Slots are physical: a block shared by several sequences counts once. Only a sequence's
        tail block can be partly empty, and tails are never shared, so the empty slots are the
        sum of each sequence's tail gap: internal fragmentation for paged blocks, reserved but
        unused slots for reserved regions (``reserved``)."""
        gap = entries = longest = 0
        bs = self._block_size
        for st in self._seqs.values():
            n = len(st.block_ids)
            gap += n * bs - st.num_tokens
            entries += n
            longest = max(longest, n)
        num_used = num_total_blocks - num_empty_blocks - num_cached_blocks
        allocated = num_used * bs
        return KVCacheStats(
            block_size=bs,
            num_total_blocks=num_total_blocks,
            num_empty_blocks=num_empty_blocks,
            num_used_blocks=num_used,
            num_cached_blocks=num_cached_blocks,
            num_seqs=len(self._seqs),
            used_slots=allocated - gap,
            allocated_slots=allocated,
            internal_fragmentation_slots=0 if reserved else gap,
            reserved_unused_slots=gap if reserved else 0,
            block_table_entries=entries,
            padded_table_bytes=len(self._seqs) * longest * INT32_BYTES,
            prefix_query_tokens=self._prefix.query_tokens,
            prefix_hit_tokens=self._prefix.hit_tokens,
            num_evictions=num_evictions,
        )

    def _check_tables(self, ref_counts: Sequence[int] | None, pinned: Sequence[int] = ()) -> None:
        """Invariants over the block tables: lengths match token counts, every entry is owned
        (a ``pinned`` block holds one more reference per pin), and no block that can still be
        written (a partial tail) is shared."""
        bs = self._block_size
        owners: dict[int, int] = {}
        for b in pinned:
            owners[b] = owners.get(b, 0) + 1
        for sid, st in self._seqs.items():
            assert len(st.block_ids) == ceil_div(st.num_tokens, bs), f"seq {sid}: table length"
            for b in st.block_ids:
                assert b != NULL_BLOCK_ID or ref_counts is None, f"seq {sid} holds the null block"
                owners[b] = owners.get(b, 0) + 1
            if st.num_tokens % bs and ref_counts is not None:
                tail = st.block_ids[-1]
                assert ref_counts[tail] == 1, f"seq {sid}: writable tail block {tail} is shared"
        if ref_counts is not None:
            for b, n in owners.items():
                assert ref_counts[b] == n, f"block {b}: ref_count {ref_counts[b]} != {n} owners"
