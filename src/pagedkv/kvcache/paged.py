"""``PagedAllocator``: fixed-size blocks with a hash-chain prefix cache (vLLM style).

Any block size >= 1. Full blocks are registered in the pool's hash index when they fill; a new
sequence reuses the longest chain of cached full blocks (never its last token, so that logits
exist). Freed full blocks keep their hash and are evicted lazily: a new block is an empty one
while any is left, else the least recently freed cached one (see ``block_pool.py``). With
lower tiers (``set_tiers``, ``kvcache/tiers/``) a match continues where the device chain
breaks, and evicted blocks are offered to the host tier. With a prefix match unit below the
block size (``partial.py``) a match may end inside a block: its matched slots are copied into a
fresh block, or the block is claimed in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pagedkv.kvcache.allocator_base import BlockTableAllocator, SeqBlocks, ceil_div
from pagedkv.kvcache.block_pool import BlockPool
from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import (
    DEFAULT_HASH_ALGORITHM,
    BlockHash,
    HashExtraKeys,
    RootHashes,
    get_hash_fn,
    hash_blocks,
)
from pagedkv.kvcache.paged_admit import admit
from pagedkv.kvcache.partial import PartialReuse, check_prefix_match_unit
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike
from pagedkv.kvcache.tiers.chain import TierChain
from pagedkv.kvcache.tiers.contract import NO_TIER_ORDERS, KVTier, TierOrders


class PagedAllocator(BlockTableAllocator):
    """``num_blocks`` blocks of ``block_size`` tokens (block 0 is the null block); prefix
    matches in units of ``prefix_match_unit`` tokens (None: the block size, whole blocks)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
        prefix_match_unit: int | None = None,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)  # validates both numbers
        super().__init__(block_size)
        self.prefix_caching = prefix_caching
        unit = block_size if prefix_match_unit is None else prefix_match_unit
        check_prefix_match_unit(unit, block_size)
        if unit < block_size and not prefix_caching:
            raise ValueError("a prefix match unit below the block size needs prefix caching")
        self.prefix_match_unit = unit
        self._hash_fn = get_hash_fn(hash_algorithm)
        self.partial = PartialReuse(self.pool, unit, self._hash_fn) if unit < block_size else None
        self._roots = RootHashes(self._hash_fn)  # the parent hash of block 0, per tenant
        # The hashes computed by the last match_prefix, reused by the admission right after it.
        self._last_match: tuple[int, int, HashExtraKeys, list[BlockHash]] | None = None
        self.tiers: TierChain | None = None  # lower tiers (``kvcache/tiers/``); None = none
        self.events: KVEventLog | None = None  # KV events (``enable_events``); None = off

    def set_tiers(self, tiers: Sequence[KVTier]) -> None:
        """Continue prefix matches in ``tiers`` (in order) and offer evicted blocks to them;
        the step's copies come out of ``drain_tier_orders``. Call before the first admission."""
        if not self.prefix_caching:
            raise ValueError("lower KV tiers need prefix caching (they are keyed by block hash)")
        self.tiers = TierChain(tiers)
        self.pool.on_evict = self.tiers.evicted if self.partial is None else self._evicted
        if self.events is not None:
            self.tiers.enable_events(self.events, self._block_size)

    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool evicts a block: offered to the tiers unless it is a kept partial tail."""
        assert self.tiers is not None and self.partial is not None
        if self.partial.offered(block_hash):
            self.tiers.evicted(block_id, block_hash)

    def drain_tier_orders(self) -> TierOrders:
        orders = self.tiers.drain() if self.tiers is not None else NO_TIER_ORDERS
        copies = self.partial.drain() if self.partial is not None else ()
        return replace(orders, prefix_copies=copies) if copies else orders

    def enable_events(self, log: KVEventLog) -> None:
        """Report every hash entering or leaving the prefix cache to ``log`` (``events.py``),
        starting with ``AllBlocksCleared`` and the hashes held now."""
        self.events = self.pool.events = log
        log.cleared()
        for h in self.pool.index:  # a snapshot: one run per block, parents unknown
            log.stored([h], None, self._block_size)
        if self.tiers is not None:
            self.tiers.enable_events(log, self._block_size)

    def lower_tiers(self) -> tuple[KVTier, ...]:
        return self.tiers.tiers if self.tiers is not None else ()

    def prefix_hashes(self) -> set[BlockHash]:
        """Device hashes only; a host tier's are ``tiers``' (``HostTierIndex.hashes``)."""
        return set(self.pool.index)

    def _set_hashes(
        self,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent: BlockHash | None,
        seq: SeqLike,
        first_block: int,
    ) -> None:
        """``pool.set_hash`` each block (blocks ``first_block ..`` of ``seq``); the hashes new
        to the index go to the event log. ``parent``: the hash before ``hashes[0]`` (None at
        block 0)."""
        set_hash = self.pool.set_hash
        is_new = [set_hash(b, h) for b, h in zip(block_ids, hashes, strict=True)]
        extra, bs = seq.extra_keys, self._block_size
        if self.events is not None:  # with partial reuse, the blocks' tokens too (events.py)
            tokens = None
            if self.partial is not None:
                tokens = seq.token_ids[first_block * bs : (first_block + len(hashes)) * bs]
            self.events.stored_new(hashes, is_new, parent, bs, extra.lora_id, tokens)
        if self.partial is not None:
            root = parent if parent is not None else self._roots(extra)
            self.partial.hashed(block_ids, hashes, root, seq.token_ids, first_block, extra)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_allocatable_blocks(self) -> int:
        return self.pool.num_allocatable

    # -- prefix cache ----------------------------------------------------------------------

    def _prompt_hashes(self, seq: SeqLike) -> list[BlockHash]:
        """Chain hashes of every full block of ``seq.token_ids`` (cached for one sequence)."""
        n = len(seq.token_ids)
        extra = seq.extra_keys
        last = self._last_match
        if last is not None and last[0] == seq.seq_id and last[1] == n and last[2] == extra:
            return last[3]
        hashes = hash_blocks(
            seq.token_ids, self._block_size, self._roots(extra), extra=extra, hash_fn=self._hash_fn
        )
        self._last_match = (seq.seq_id, n, extra, hashes)
        return hashes

    def match_prefix(self, seq: SeqLike) -> int:
        if not self.prefix_caching or seq.seq_id in self._seqs:
            return 0
        max_blocks = (len(seq.token_ids) - 1) // self._block_size
        index = self.pool.index
        num_hit = 0
        hashes = self._prompt_hashes(seq)
        for h in hashes[:max_blocks]:
            if h not in index:
                break
            num_hit += 1
        if self.tiers is not None and num_hit < max_blocks:
            rest = hashes[num_hit:max_blocks]
            num_hit += self.tiers.match(seq.seq_id, len(seq.token_ids), num_hit, rest)
        if self.partial is None:
            return num_hit * self._block_size
        parent = hashes[num_hit - 1] if num_hit else self._roots(seq.extra_keys)
        limit = min(len(seq.token_ids) - 1, seq.num_known_tokens)
        return num_hit * self._block_size + self.partial.match(seq, parent, num_hit, limit)

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        st = self._seqs.get(seq.seq_id)
        if st is None:
            return admit(self, seq, num_new_tokens, num_cached_tokens)
        if num_cached_tokens:
            raise ValueError(f"sequence {seq.seq_id} is already admitted; num_cached_tokens=0")
        self._check_count("num_new_tokens", num_new_tokens)
        total = st.num_tokens + num_new_tokens
        bs = self._block_size
        self._check_known_tokens(seq, total)
        need = ceil_div(total, bs) - len(st.block_ids)
        if need > 0:
            if need > self.pool.num_allocatable:
                return False
            st.block_ids.extend(self.pool.take(need))
        st.num_tokens = total
        if self.prefix_caching and total // bs > len(st.block_hashes):
            self._register_full_blocks(seq, st)
        return True

    def _register_full_blocks(
        self, seq: SeqLike, st: SeqBlocks, known: list[BlockHash] | None = None
    ) -> None:
        """Hash the blocks of ``st`` that became full and enter them in the index."""
        first = len(st.block_hashes)
        # A placeholder (a token scheduled before it was sampled) is hashed once it is known.
        num_full = min(st.num_tokens, seq.num_known_tokens) // self._block_size
        if num_full <= first:
            return
        if known is not None and len(known) >= num_full:
            new = known[first:num_full]
        else:
            parent = st.block_hashes[-1] if st.block_hashes else self._roots(seq.extra_keys)
            new = hash_blocks(
                seq.token_ids,
                self._block_size,
                parent,
                first_block=first,
                num_blocks=num_full - first,
                extra=seq.extra_keys,
                hash_fn=self._hash_fn,
            )
        ids = st.block_ids
        prev_hash = st.block_hashes[-1] if st.block_hashes else None
        self._set_hashes(ids[first:num_full], new, prev_hash, seq, first)
        st.block_hashes.extend(new)
        if self.tiers is not None:
            self.tiers.computed(ids[first:num_full], new)

    def tokens_known(self, seq: SeqLike) -> None:
        st = self._seqs.get(seq.seq_id)
        if st is not None and self.prefix_caching:
            self._register_full_blocks(seq, st)

    def free(self, seq: SeqLike, preempted: bool = False) -> None:
        st = self._pop(seq, preempted)
        # Tail first, so that the tail is evicted before the head. Exactly the first
        # len(block_hashes) blocks hold a hash (checked by check_invariants), and a partly
        # filled tail kept for partial reuse holds its key.
        num_hashed = len(st.block_hashes)
        if self.partial is not None:
            root = self._roots(seq.extra_keys)
            num_hashed += self.partial.keep_tail(seq, st, root, self.events)
        self.pool.release_table(st.block_ids, num_hashed)

    def fork(self, parent: SeqLike, child: SeqLike) -> list[tuple[int, int]] | None:
        st = self._check_fork(parent, child)
        n = st.num_tokens
        num_full = n // self._block_size
        partial = num_full < len(st.block_ids)
        if partial and self.pool.num_allocatable < 1:
            return None
        shared = st.block_ids[:num_full]
        self.pool.share(shared)
        copies: list[tuple[int, int]] = []
        ids = list(shared)
        if partial:
            (dst,) = self.pool.take(1)
            copies.append((st.block_ids[-1], dst))
            ids.append(dst)
        new = SeqBlocks(ids, n)
        new.block_hashes = list(st.block_hashes)
        self._seqs[child.seq_id] = new
        return copies

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unreferenced) block; returns how many were dropped."""
        return self.pool.evict_all_cached()

    # -- inspection ------------------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        pool = self.pool
        # A copy source pinned for the step and held by no sequence counts as the cached
        # block it is again at the step's end.
        pinned = self.partial.num_pinned_only() if self.partial is not None else 0
        stats = self._make_stats(
            pool.num_usable_blocks,
            pool.num_empty,
            pool.num_cached + pinned,
            pool.num_evictions,
        )
        if self.partial is not None:
            stats = self.partial.with_counts(stats)
        return stats if self.tiers is None else self.tiers.with_hits(stats, self._block_size)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        pins = self.partial.pins if self.partial is not None else []
        self._check_tables(self.pool.ref_counts, pins)
        referenced = {b for st in self._seqs.values() for b in st.block_ids}
        in_use = sum(1 for b in range(1, self.pool.num_blocks) if self.pool.ref_counts[b] > 0)
        assert in_use == len(referenced | set(pins)), "a block is in use that no sequence holds"
        if self.partial is not None:
            self.partial.index.check_invariants(self.pool.index)
        bs = self._block_size
        hashes = self.pool.block_hashes
        for sid, st in self._seqs.items():
            k = len(st.block_hashes)
            assert k <= st.num_tokens // bs, f"seq {sid}: hashed a partial block"
            assert [hashes[b] for b in st.block_ids[:k]] == st.block_hashes, f"seq {sid}: hashes"
            assert all(hashes[b] is None for b in st.block_ids[k:]), f"seq {sid}: stray hash"
