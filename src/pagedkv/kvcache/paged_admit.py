"""The admission of a sequence into a ``PagedAllocator``: its first ``allocate`` call.

One story, split from ``paged.py`` for size: the prefix hit ``match_prefix`` returned is taken
as whole blocks from the device (shared by reference count), then whole blocks from the lower
tiers (claimed there, loaded into fresh device blocks), then at most one partial block
(``partial.py``: claimed in place or copied into a fresh block), then fresh blocks for the
tokens to compute. All or nothing: a refusal changes nothing but the plans of the last match
(the caller matches again before the next try).
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.kvcache.allocator_base import PrefixCounters, SeqBlocks, ceil_div
from pagedkv.kvcache.block_pool import BlockPool
from pagedkv.kvcache.hashing import BlockHash, HashExtraKeys
from pagedkv.kvcache.partial import PartialReuse
from pagedkv.kvcache.protocol import SeqLike
from pagedkv.kvcache.tiers.chain import TierChain


class PagedAllocator(Protocol):
    """What an admission reads and writes of ``paged.PagedAllocator`` (a protocol, so that this
    module does not import the allocator it is split from)."""

    pool: BlockPool
    tiers: TierChain | None
    partial: PartialReuse | None
    prefix_caching: bool
    prefix_match_unit: int
    _seqs: dict[int, SeqBlocks]
    _prefix: PrefixCounters
    _last_match: tuple[int, int, HashExtraKeys, list[BlockHash]] | None

    @property
    def block_size(self) -> int: ...

    def _check_new(self, seq: SeqLike) -> None: ...
    def _check_count(self, name: str, value: int) -> None: ...
    def _check_known_tokens(self, seq: SeqLike, total_tokens: int) -> None: ...
    def _prompt_hashes(self, seq: SeqLike) -> list[BlockHash]: ...
    def _set_hashes(
        self,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent: BlockHash | None,
        seq: SeqLike,
        first_block: int,
    ) -> None: ...
    def _register_full_blocks(
        self, seq: SeqLike, st: SeqBlocks, known: list[BlockHash] | None = None
    ) -> None: ...


def check_admission(
    alloc: PagedAllocator, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int
) -> int:
    """The argument checks of an admission (ValueError); returns its total tokens."""
    alloc._check_new(seq)
    alloc._check_count("num_new_tokens", num_new_tokens)
    alloc._check_count("num_cached_tokens", num_cached_tokens)
    total = num_cached_tokens + num_new_tokens
    alloc._check_known_tokens(seq, total)
    unit = alloc.prefix_match_unit
    if num_cached_tokens % unit or (num_cached_tokens and num_cached_tokens >= len(seq.token_ids)):
        what = "block_size" if unit == alloc.block_size else "prefix_match_unit"
        raise ValueError(
            f"num_cached_tokens={num_cached_tokens} must be a multiple of {what}={unit} "
            "below the number of tokens, as returned by match_prefix"
        )
    if num_cached_tokens and not alloc.prefix_caching:
        raise ValueError("num_cached_tokens must be 0 when prefix caching is off")
    return total


def admit(alloc: PagedAllocator, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int) -> bool:
    """Admit ``seq`` with ``num_cached_tokens`` reused and ``num_new_tokens`` to compute (the
    module docstring); False when the pool cannot hold it."""
    total = check_admission(alloc, seq, num_new_tokens, num_cached_tokens)
    bs, pool, chain, partial = alloc.block_size, alloc.pool, alloc.tiers, alloc.partial
    num_hit, num_partial = divmod(num_cached_tokens, bs)
    # A hit ending inside block num_hit: the block holding its tokens (checked first).
    src = partial.source(seq, num_hit, num_partial) if partial and num_partial else None
    hashes = alloc._prompt_hashes(seq) if alloc.prefix_caching else []
    hit_ids: list[int] = []
    refs = pool.ref_counts
    num_revived = 0
    for h in hashes[:num_hit]:
        b = pool.lookup(h)
        if b is None:
            if chain is not None:
                break  # the rest come from the lower tiers (checked by claim)
            raise ValueError(
                f"sequence {seq.seq_id}: the prefix match is stale (a cached block was "
                "evicted); call match_prefix again right before allocate"
            )
        hit_ids.append(b)
        num_revived += refs[b] == 0
    num_device = len(hit_ids)
    need = ceil_div(total, bs) - num_device
    claim = partial is not None and src is not None and partial.claimable(src)
    # A cached copy source is pinned: one allocatable block less (a claim takes one less).
    pinned = src is not None and not claim and refs[src] == 0
    if need + num_revived + pinned > pool.num_allocatable:
        if chain is not None:
            chain.forget_plan()
        return False
    loaded = hashes[num_device:num_hit]
    if loaded:  # claimed before take(), whose evictions must not push them out of a tier
        assert chain is not None
        tier_names = chain.claim(seq.seq_id, len(seq.token_ids), num_device, loaded)
    pool.share(hit_ids)
    if partial is not None and src is not None:  # before take(), which must not evict it
        partial.hold(src, claim)
    hit_ids.extend(pool.take(need - claim))
    if partial is not None and src is not None:
        partial.place(hit_ids, num_hit, src, claim, num_partial)
    if loaded:
        assert chain is not None
        fresh = hit_ids[num_device:num_hit]
        chain.order_loads(tier_names, loaded, fresh)
        parent = hashes[num_device - 1] if num_device else None
        alloc._set_hashes(fresh, loaded, parent, seq, num_device)
    st = SeqBlocks(hit_ids, total)
    st.block_hashes = hashes[:num_hit]
    alloc._seqs[seq.seq_id] = st
    alloc._prefix.query_tokens += len(seq.token_ids)
    alloc._prefix.hit_tokens += num_cached_tokens
    alloc._last_match = None
    if alloc.prefix_caching and total // bs > num_hit:
        alloc._register_full_blocks(seq, st, hashes)
    return True
