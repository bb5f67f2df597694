"""Partial-block prefix reuse: a prefix match in units of ``U`` tokens inside blocks of ``B``.

With whole-block reuse (``U = B``, the default) every shared prefix loses its last partial
block: up to ``B - 1`` tokens are recomputed per hit, the first article's third ledger. With a
prefix-match unit ``U`` dividing ``B``, ``PagedAllocator.match_prefix`` continues where the
block chain (device, then lower tiers) stops: among the cached full blocks that follow the last
matched block, it finds the one sharing the most leading tokens with the prompt's next block,
rounded down to a multiple of ``U``. The admission then

* **claims that block in place** when nothing else references it and no cached block follows
  it (an unused leaf, TensorRT-LLM's rule): the block loses its hash, as if evicted (offered to
  the host tier, a removal event), keeps its first ``m`` slots and the forward pass overwrites
  the rest;
* **else copies** its first ``m`` slots of every layer into a fresh block (a ``PrefixCopy``
  order the engine applies before the forward pass, with copy-on-write's copies); the source is
  pinned until the step's orders are drained, so no allocation of the same step evicts it.

Either way the ``m`` tokens count as a prefix hit, and the rest of the block is computed.

**The index: a per-block token trie, flattened.** For each parent hash (the chained hash of a
block, or a tenant's root) the index keeps the token ids of the cached full blocks that follow
it, as byte strings in sorted order. The string sharing the longest prefix with a query is one
of the query's two neighbours in that order, so a lookup is one ``bisect`` and two
binary-searched comparisons: O(log children + log B), whatever ``U``. Chosen over chained
hashes per unit because those cost ``B / U`` hashes and index entries per block (128 per
block at ``U = 1``, ``B = 128``) on every prompt, whereas this index costs one entry of ``4B``
bytes per cached block, is touched only where a match stops, and answers every ``U`` at once.
The block-chain hashes, their index and their events stay exactly those of ``U = B``.

**What is never reused partially.** A block computed in the current step (its KV is written by
the forward pass, after the step's copies): ``fresh`` blocks are not sources until the next
step. A block whose tokens carry multimodal spans (its KV depends on more than its token ids),
and a prompt block with spans. Lower tiers (host, store) return whole blocks only
(``docs/prefix_cache.md`` says why).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pagedkv.kvcache.block_pool import BlockPool
from pagedkv.kvcache.hashing import BlockHash, HashExtraKeys, token_bytes
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike
from pagedkv.kvcache.tiers.contract import PrefixCopy

_TOKEN_BYTES = 4  # ``hashing.token_bytes``: little-endian uint32


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two serialised token strings share (binary search on slice equality:
    O(log n) C-level comparisons)."""
    n = min(len(a), len(b)) // _TOKEN_BYTES
    if a[: n * _TOKEN_BYTES] == b[: n * _TOKEN_BYTES]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi], in tokens
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * _TOKEN_BYTES] == b[: mid * _TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


class SiblingIndex:
    """Parent hash -> ``(token bytes, child hash)`` of its indexed children, sorted."""

    def __init__(self) -> None:
        self._children: dict[BlockHash, list[tuple[bytes, BlockHash]]] = {}
        self._parent_of: dict[BlockHash, tuple[BlockHash, bytes]] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def __contains__(self, child: BlockHash) -> bool:
        return child in self._parent_of

    def add(self, parent: BlockHash, child: BlockHash, tokens: bytes) -> None:
        """Index ``child`` (a full block's hash) under ``parent``; idempotent."""
        if child in self._parent_of:
            return
        self._parent_of[child] = (parent, tokens)
        insort(self._children.setdefault(parent, []), (tokens, child))

    def remove(self, child: BlockHash) -> None:
        """Forget ``child`` (no-op for a hash never added)."""
        entry = self._parent_of.pop(child, None)
        if entry is None:
            return
        parent, tokens = entry
        siblings = self._children[parent]
        del siblings[bisect_left(siblings, (tokens, child))]
        if not siblings:
            del self._children[parent]

    def has_children(self, parent: BlockHash) -> bool:
        return parent in self._children

    def candidates(self, parent: BlockHash, query: bytes) -> list[tuple[int, BlockHash]]:
        """``(shared tokens, child)`` of the (at most two) children next to ``query`` in sorted
        order, most shared first; one of them shares the most tokens of any child."""
        siblings = self._children.get(parent)
        if not siblings:
            return []
        i = bisect_left(siblings, (query,))
        out = [
            (common_prefix_tokens(siblings[j][0], query), siblings[j][1])
            for j in (i - 1, i)
            if 0 <= j < len(siblings)
        ]
        return sorted((c for c in out if c[0] > 0), reverse=True)

    def check_invariants(self, indexed: set[BlockHash] | dict[BlockHash, int]) -> None:
        count = 0
        for parent, siblings in self._children.items():
            assert siblings == sorted(siblings), f"children of {parent.hex()[:8]} unsorted"
            for tokens, child in siblings:
                assert self._parent_of[child] == (parent, tokens), "sibling entry drifted"
                assert child in indexed, "a partial-match entry outlives its block's hash"
            count += len(siblings)
        assert count == len(self._parent_of), "sibling entries counted twice"


@dataclass
class PartialCounters:
    """Running totals (plain ints, mutated in place)."""

    num_hits: int = 0  # admissions whose hit ends inside a block
    hit_tokens: int = 0  # of their prefix hits, the tokens of that partial block
    copied_tokens: int = 0  # slots copied (a block claimed in place copies none)
    num_claims: int = 0  # partial blocks claimed in place


@dataclass
class _Plan:
    """What the last ``match`` found, for the admission of the same sequence right after."""

    key: tuple[int, int, HashExtraKeys, int]  # seq id, its tokens, extra keys, block index
    src_hash: BlockHash
    num_matched: int


@dataclass
class PartialReuse:
    """The paged allocator's partial-reuse state over ``pool``: the sibling index, the last
    match's plan, and the step's fresh blocks, pins and copy orders (``drain``)."""

    pool: BlockPool
    unit: int  # tokens; divides pool.block_size and is below it
    index: SiblingIndex = field(default_factory=SiblingIndex)
    counters: PartialCounters = field(default_factory=PartialCounters)
    fresh: set[int] = field(default_factory=set)  # blocks hashed this step (KV not yet written)
    pins: list[int] = field(default_factory=list)  # copy sources held until the step ends
    copies: list[PrefixCopy] = field(default_factory=list)
    plan: _Plan | None = None

    def __post_init__(self) -> None:
        self.pool.on_unindex = self.index.remove

    def hashed(
        self,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent: BlockHash,
        token_ids: Sequence[int],
        first_block: int,
        extra: HashExtraKeys,
    ) -> None:
        """Blocks ``first_block ..`` of a sequence (``token_ids``) got their chained
        ``hashes`` (``parent`` before the first): they are fresh this step, and indexed
        unless multimodal spans cover them."""
        self.fresh.update(block_ids)
        bs = self.pool.block_size
        for k, h in enumerate(hashes):
            start = (first_block + k) * bs
            if h in self.pool.index and not _has_spans(extra, start, start + bs):
                self.index.add(parent, h, token_bytes(token_ids[start : start + bs]))
            parent = h

    def match(self, seq: SeqLike, parent: BlockHash, block_index: int, limit_tokens: int) -> int:
        """Tokens of block ``block_index`` of ``seq`` (none beyond ``limit_tokens`` of the
        sequence) that a cached full block after ``parent`` holds, a multiple of ``unit``
        (0: none); the plan is kept for the admission right after."""
        self.plan = None
        bs = self.pool.block_size
        start = block_index * bs
        end = min(start + bs, limit_tokens)
        if end - start < self.unit or _has_spans(seq.extra_keys, start, end):
            return 0
        query = token_bytes(seq.token_ids[start:end])
        index, fresh = self.pool.index, self.fresh
        for shared, child in self.index.candidates(parent, query):
            matched = shared - shared % self.unit
            block = index.get(child)
            if matched and block is not None and block not in fresh:
                key = (seq.seq_id, len(seq.token_ids), seq.extra_keys, block_index)
                self.plan = _Plan(key, child, matched)
                return matched
        return 0

    def source(self, seq: SeqLike, block_index: int, num_tokens: int) -> int:
        """The block the last ``match`` found for this admission of ``seq``, checked;
        ValueError when there was no such match or its block is gone."""
        p, self.plan = self.plan, None
        block = None
        key = (seq.seq_id, len(seq.token_ids), seq.extra_keys, block_index)
        if p is not None and p.key == key and 0 < num_tokens <= p.num_matched:
            block = self.pool.index.get(p.src_hash)
        if block is None or block in self.fresh or num_tokens % self.unit:
            raise ValueError(
                f"sequence {seq.seq_id}: a partial prefix hit of {num_tokens} tokens in block "
                f"{block_index} was not matched right before this admission, or is stale; call "
                "match_prefix again right before allocate"
            )
        return block

    def claimable(self, block: int) -> bool:
        """Whether a partial hit may take ``block`` itself: unreferenced and a leaf."""
        h = self.pool.block_hashes[block]
        return self.pool.ref_counts[block] == 0 and h is not None and not self.index.has_children(h)

    def hold(self, src: int, claim: bool) -> None:
        """Before the admission takes fresh blocks: claim ``src`` in place (out of the cached
        blocks, its hash dropped), or pin it as a copy source (one reference until ``drain``)."""
        if claim:
            self.pool.claim(src)
        else:
            self.pool.share([src])
            self.pins.append(src)

    def place(
        self, block_ids: list[int], block_index: int, src: int, claim: bool, num_tokens: int
    ) -> None:
        """After: put the claimed ``src`` at ``block_index`` of the new table ``block_ids``,
        or order the copy of its first ``num_tokens`` slots into the fresh block there."""
        c = self.counters
        if claim:
            block_ids.insert(block_index, src)
            c.num_claims += 1
        else:
            self.copies.append(PrefixCopy(src, block_ids[block_index], num_tokens))
            c.copied_tokens += num_tokens
        c.num_hits += 1
        c.hit_tokens += num_tokens

    def num_pinned_only(self) -> int:
        """Pinned blocks no sequence holds (every reference is a pin)."""
        refs = self.pool.ref_counts
        return sum(1 for b in set(self.pins) if refs[b] == self.pins.count(b))

    def with_counts(self, stats: KVCacheStats) -> KVCacheStats:
        """``stats`` with this allocator's partial-reuse counters."""
        c = self.counters
        return replace(
            stats,
            num_partial_hits=c.num_hits,
            partial_hit_tokens=c.hit_tokens,
            partial_copied_tokens=c.copied_tokens,
            num_partial_claims=c.num_claims,
        )

    def drain(self) -> tuple[PrefixCopy, ...]:
        """The step's copy orders, handed out once; the step ends: pins are released and no
        block is fresh any more."""
        out = tuple(self.copies)
        self.copies.clear()
        if self.pins:
            self.pool.release(self.pins)
            self.pins.clear()
        self.fresh.clear()
        self.plan = None
        return out


def _has_spans(extra: HashExtraKeys, start: int, end: int) -> bool:
    return any(s.offset < end and s.offset + s.length > start for s in extra.mm_spans)


def check_prefix_match_unit(unit: int, block_size: int) -> None:
    """ValueError unless ``unit`` is a whole number of tokens >= 1 dividing ``block_size``."""
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValueError(f"the prefix match unit must be an integer >= 1 token, got {unit!r}")
    if block_size % unit:
        raise ValueError(
            f"the prefix match unit ({unit} tokens) must divide the block size ({block_size})"
        )
