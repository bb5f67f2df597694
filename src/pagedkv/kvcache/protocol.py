"""The contract between the scheduler (or the engine) and a KV cache allocator.

Three allocators implement it: ``PagedAllocator`` (fixed-size blocks, hash-chain prefix cache),
``RadixAllocator`` (radix tree over token ids, page granular) and ``ReservedAllocator`` (one
contiguous region of ``max_model_len`` slots per sequence). All of them hand out *slots*
(``slot = block_table[i // block_size] * block_size + i % block_size``), so any of them can
drive the real model.

Life of a sequence, as the scheduler sees it::

    hit = alloc.match_prefix(seq)                 # query only; nothing is taken yet
    ok = alloc.allocate(seq, n, num_cached_tokens=hit)   # first call admits: all or nothing
    ...                                           # seq.num_computed_tokens = hit
    alloc.slot_mapping(seq, start, end)           # where the KV of tokens [start, end) goes
    ok = alloc.allocate(seq, 1)                   # later calls grow by n tokens
    copies = alloc.fork(seq, child)               # copy-on-write: engine copies (src, dst)
    alloc.free(seq)                               # blocks return; cached ones stay revivable
    alloc.free(seq, preempted=True)               # ... and the sequence may be admitted again

Contract shared by every allocator:

* ``allocate`` never allocates partially: it returns ``False`` and changes nothing when the
  free pool (free blocks plus cached blocks that may be evicted) cannot hold the request.
* Token ids of the tokens being allocated must already be in ``seq.token_ids``: full blocks are
  registered in the prefix cache at allocation time. The engine writes every new slot of a step
  before attention reads any, so a block hit in the same step is already filled when read.
* Misuse (unknown or freed sequence, double admission, negative counts) raises ``ValueError``
  and leaves the allocator unchanged.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash, HashExtraKeys
from pagedkv.kvcache.tiers.contract import KVTier, TierOrders

# The placeholder contract, stated once: a sequence of an engine that schedules one step ahead
# ends in at most this many tokens not drawn yet: the one being computed (drawn by the step
# before) and the one the step being computed will draw.
MAX_PLACEHOLDERS = 2


@runtime_checkable
class SeqLike(Protocol):
    """What an allocator reads from a sequence. ``sched.Seq`` satisfies it."""

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """The prompt, then the generated tokens; the last may be a placeholder (see
        ``num_known_tokens``)."""
        ...

    @property
    def num_known_tokens(self) -> int:
        """``token_ids[:num_known_tokens]`` are known; the rest (at most
        ``MAX_PLACEHOLDERS``) are tokens an asynchronous engine scheduled before sampling
        them. Allocators hash known tokens only, and ``tokens_known`` catches up once the
        engine writes the values."""
        ...

    @property
    def extra_keys(self) -> HashExtraKeys:
        """Keys besides the token ids that decide whether KV may be shared (salt, LoRA, media)."""
        ...


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of one allocator. Slots are token positions; blocks hold ``block_size`` slots.

    ``num_empty_blocks + num_used_blocks + num_cached_blocks == num_total_blocks`` always.
    """

    block_size: int
    num_total_blocks: int
    num_empty_blocks: int  # unreferenced and holding nothing reusable
    num_used_blocks: int  # referenced by at least one live sequence
    num_cached_blocks: int  # referenced by none, but still revivable by a prefix hit
    num_seqs: int
    used_slots: int  # slots holding a token of a live sequence (a shared block counts once)
    allocated_slots: int  # slots of the blocks in use (num_used_blocks * block_size)
    internal_fragmentation_slots: int  # allocated - used: the empty ends of tail blocks
    reserved_unused_slots: int  # reserved-allocator regions beyond what the sequence stored
    block_table_entries: int  # sum over live sequences of their block-table lengths
    padded_table_bytes: int  # int32 [num_seqs, max_blocks] export of all live sequences
    prefix_query_tokens: int  # prompt tokens looked up at admission
    prefix_hit_tokens: int  # of those, tokens whose KV was reused
    num_evictions: int  # cached blocks dropped to make room
    # Of prefix_hit_tokens, how many each tier supplied ("device" first, then the lower tiers
    # of ``tiers/contract.py``); empty for an allocator without lower tiers (all hits are device hits).
    tier_hit_tokens: tuple[tuple[str, int], ...] = ()
    # Partial-block reuse (``partial.py``; all 0 unless the prefix match unit is below B):
    # admissions whose hit ends inside a block, the hit tokens of those blocks (part of
    # prefix_hit_tokens), the slots copied for them and the blocks claimed in place instead.
    num_partial_hits: int = 0
    partial_hit_tokens: int = 0
    partial_copied_tokens: int = 0
    num_partial_claims: int = 0

    @property
    def num_total_slots(self) -> int:
        return self.num_total_blocks * self.block_size

    @property
    def kv_utilization(self) -> float:
        """Used slots over the whole pool (0..1); a shared slot counts once."""
        return self.used_slots / self.num_total_slots if self.num_total_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )


@runtime_checkable
class KVAllocator(Protocol):
    """The allocator contract (see the module docstring for the life of a sequence)."""

    @property
    def block_size(self) -> int:
        """Tokens per block (pages for the radix allocator, regions for the reserved one)."""
        ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation may take now: empty ones plus evictable cached ones
        (``stats().num_empty_blocks + stats().num_cached_blocks``)."""
        ...

    def match_prefix(self, seq: SeqLike) -> int:
        """Tokens of ``seq.token_ids`` whose KV is already cached, for a sequence not yet
        admitted: a multiple of the prefix match unit (the block size unless partial reuse is
        on). Never all of them: the last token is always recomputed. Mutates nothing."""
        ...

    def allocate(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens, or return False and change
        nothing. On the first call for a sequence, ``num_cached_tokens`` must be the value
        ``match_prefix`` just returned (or less, a multiple of ``block_size``, or of the prefix
        match unit within the matched partial block); those blocks are shared (a partial one
        is copied or claimed: ``partial.py``) and the new slots start after them."""
        ...

    def tokens_known(self, seq: SeqLike) -> None:
        """``seq``'s placeholder became a known token: enter the blocks it completed in the
        prefix cache (a no-op for allocators without one, or when nothing completed)."""
        ...

    def free(self, seq: SeqLike, preempted: bool = False) -> None:
        """Release every block of ``seq``. Full blocks stay in the prefix cache until evicted.
        Unless ``preempted``, the sequence is finished: allocating for it again raises."""
        ...

    def fork(self, parent: SeqLike, child: SeqLike) -> list[tuple[int, int]] | None:
        """Admit ``child`` holding the same tokens as ``parent``: full blocks are shared by
        reference count, the partial tail is copied into a fresh block. Returns the
        ``(src_block, dst_block)`` copies the engine must apply before the next forward pass, or
        None (nothing changed) when no block is free for the copy."""
        ...

    def num_tokens(self, seq: SeqLike) -> int:
        """Tokens of ``seq`` that have slots."""
        ...

    def has_seq(self, seq: SeqLike) -> bool:
        """Whether ``seq`` holds blocks here now (admitted and not freed)."""
        ...

    def block_table(self, seq: SeqLike) -> Sequence[int]:
        """The block ids of ``seq`` in logical order. A read-only view: do not keep it across
        calls that mutate the allocator."""
        ...

    def slot_mapping(self, seq: SeqLike, start: int, end: int) -> list[int]:
        """Slots of tokens ``[start, end)`` of ``seq``; ``end <= num_tokens(seq)``."""
        ...

    def block_tables(
        self, seqs: Sequence[SeqLike], max_blocks: int | None = None
    ) -> tuple[array, int]:
        """Row-major int32 ``[len(seqs), width]`` block tables padded with the null block 0,
        and ``width`` (``max_blocks`` or the longest table). A fresh array the caller may keep."""
        ...

    def stats(self) -> KVCacheStats: ...

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        ...

    # -- what the engine, the simulator and a router's index read besides the slots --------

    def enable_events(self, log: KVEventLog) -> None:
        """From now on report every block hash entering or leaving the prefix cache to ``log``
        (``events.py``), starting with ``AllBlocksCleared`` and the hashes held now, so that
        replaying the log gives ``prefix_hashes()``. An allocator without a prefix cache
        (reserved) reports only that it holds nothing. Called by the engine's KV events and
        the simulator's replicas; the radix allocator requires it before the first admission
        (ValueError after)."""
        ...

    def prefix_hashes(self) -> set[BlockHash]:
        """The chained hashes of every block the device prefix cache holds now (lower tiers'
        are not included). A fresh set the caller may keep; O(cached blocks): for snapshots
        and checks, not for every step."""
        ...

    def lower_tiers(self) -> tuple[KVTier, ...]:
        """The lower tiers (``kvcache/tiers/``) in lookup order; empty for an allocator
        without them. The engine's KV events read the ones that report events."""
        ...

    def drain_tier_orders(self) -> TierOrders:
        """The lower-tier copies (offloads, loads, saves) and the partial prefix hits' device
        copies ordered since the last call, handed out once; ``NO_TIER_ORDERS`` when there are
        none. The scheduler calls it at the end of every ``schedule()`` and puts the orders in
        the batch: it is the step boundary (a partial hit's copy source stays pinned until it)."""
        ...
