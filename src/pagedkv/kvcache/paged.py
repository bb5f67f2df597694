"""``PagedAllocator``: fixed-size blocks with a hash-chain prefix cache (vLLM style).

Any block size >= 1. Full blocks are registered in the pool's hash index when they fill; a new
sequence reuses the longest chain of cached full blocks (never its last token, so that logits
exist). Freed full blocks keep their hash and are evicted lazily: a new block is an empty one
while any is left, else the least recently freed cached one (see ``block_pool.py``). With
lower tiers (``set_tiers``, ``kvcache/tiers/``) a match continues where the device chain
breaks, and evicted blocks are offered to the host tier.
"""

from __future__ import annotations

from collections.abc import Sequence

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
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike
from pagedkv.kvcache.tiers.chain import TierChain
from pagedkv.kvcache.tiers.contract import NO_TIER_ORDERS, KVTier, TierOrders


class PagedAllocator(BlockTableAllocator):
    """``num_blocks`` blocks of ``block_size`` tokens (block 0 is the null block)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        hash_algorithm: str = DEFAULT_HASH_ALGORITHM,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)  # validates both numbers
        super().__init__(block_size)
        self.prefix_caching = prefix_caching
        self._hash_fn = get_hash_fn(hash_algorithm)
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
        self.pool.on_evict = self.tiers.evicted
        if self.events is not None:
            self.tiers.enable_events(self.events, self._block_size)

    def drain_tier_orders(self) -> TierOrders:
        return self.tiers.drain() if self.tiers is not None else NO_TIER_ORDERS

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
        self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parent: BlockHash | None,
        lora_id: str | None,
    ) -> None:  # fmt: skip
        """``pool.set_hash`` each block; the hashes new to the index go to the event log.
        ``parent``: the hash before ``hashes[0]`` (None at block 0)."""
        set_hash = self.pool.set_hash
        is_new = [set_hash(b, h) for b, h in zip(block_ids, hashes, strict=True)]
        if self.events is not None:
            self.events.stored_new(hashes, is_new, parent, self._block_size, lora_id)

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
        return num_hit * self._block_size

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        st = self._seqs.get(seq.seq_id)
        if st is None:
            return self._admit(seq, num_new_tokens, num_cached_tokens)
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

    def _admit(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int) -> bool:
        self._check_new(seq)
        self._check_count("num_new_tokens", num_new_tokens)
        self._check_count("num_cached_tokens", num_cached_tokens)
        bs = self._block_size
        total = num_cached_tokens + num_new_tokens
        self._check_known_tokens(seq, total)
        if num_cached_tokens % bs or (
            num_cached_tokens and num_cached_tokens >= len(seq.token_ids)
        ):
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} must be a multiple of block_size={bs} "
                "below the number of tokens, as returned by match_prefix"
            )
        if num_cached_tokens and not self.prefix_caching:
            raise ValueError("num_cached_tokens must be 0 when prefix caching is off")
        num_hit = num_cached_tokens // bs
        hashes = self._prompt_hashes(seq) if self.prefix_caching else []
        hit_ids: list[int] = []
        refs = self.pool.ref_counts
        num_revived = 0
        for h in hashes[:num_hit]:
            b = self.pool.lookup(h)
            if b is None:
                if self.tiers is not None:
                    break  # the rest come from the lower tiers (checked by claim)
                raise ValueError(
                    f"sequence {seq.seq_id}: the prefix match is stale (a cached block was "
                    "evicted); call match_prefix again right before allocate"
                )
            hit_ids.append(b)
            num_revived += refs[b] == 0
        num_device = len(hit_ids)
        need = ceil_div(total, bs) - num_device
        if need + num_revived > self.pool.num_allocatable:
            if self.tiers is not None:
                self.tiers.forget_plan()
            return False
        loaded = hashes[num_device:num_hit]
        chain = self.tiers
        if loaded:  # claimed before take(), whose evictions must not push them out of a tier
            assert chain is not None
            tier_names = chain.claim(seq.seq_id, len(seq.token_ids), num_device, loaded)
        self.pool.share(hit_ids)
        hit_ids.extend(self.pool.take(need))
        if loaded:
            assert chain is not None
            fresh = hit_ids[num_device:num_hit]
            chain.order_loads(tier_names, loaded, fresh)
            parent = hashes[num_device - 1] if num_device else None
            self._set_hashes(fresh, loaded, parent, seq.extra_keys.lora_id)
        st = SeqBlocks(hit_ids, total)
        st.block_hashes = hashes[:num_hit]
        self._seqs[seq.seq_id] = st
        self._prefix.query_tokens += len(seq.token_ids)
        self._prefix.hit_tokens += num_cached_tokens
        self._last_match = None
        if self.prefix_caching and total // bs > num_hit:
            self._register_full_blocks(seq, st, hashes)
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
        self._set_hashes(ids[first:num_full], new, prev_hash, seq.extra_keys.lora_id)
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
        # len(block_hashes) blocks hold a hash (checked by check_invariants).
        self.pool.release_table(st.block_ids, len(st.block_hashes))

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
        stats = self._make_stats(
            pool.num_usable_blocks,
            pool.num_empty,
            pool.num_cached,
            pool.num_evictions,
        )
        return stats if self.tiers is None else self.tiers.with_hits(stats, self._block_size)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self._check_tables(self.pool.ref_counts)
        referenced = {b for st in self._seqs.values() for b in st.block_ids}
        in_use = sum(1 for b in range(1, self.pool.num_blocks) if self.pool.ref_counts[b] > 0)
        assert in_use == len(referenced), "a block is in use that no sequence holds"
        bs = self._block_size
        hashes = self.pool.block_hashes
        for sid, st in self._seqs.items():
            k = len(st.block_hashes)
            assert k <= st.num_tokens // bs, f"seq {sid}: hashed a partial block"
            assert [hashes[b] for b in st.block_ids[:k]] == st.block_hashes, f"seq {sid}: hashes"
            assert all(hashes[b] is None for b in st.block_ids[k:]), f"seq {sid}: stray hash"
