"""Partial-block prefix reuse: a prefix match in units of ``U`` tokens inside blocks of ``B``.

With whole-block reuse (``U = B``, the default) every shared prefix loses its last partial
block: up to ``B - 1`` tokens are recomputed per hit, the first article's third ledger. With a
prefix-match unit ``U`` dividing ``B``, ``PagedAllocator.match_prefix`` continues where the
block chain (device, then lower tiers) stops: among the indexed blocks that follow the last
matched block, it finds the one sharing the most leading tokens with the prompt's next block,
rounded down to a multiple of ``U``. The admission then

* **claims that block in place** when nothing else references it and no indexed block follows
  it (an unused leaf, TensorRT-LLM's rule): the block loses its hash, as if evicted (offered to
  the host tier, a removal event), keeps its first ``m`` slots and the forward pass overwrites
  the rest;
* **else copies** its first ``m`` slots of every layer into a fresh block (a ``PrefixCopy``
  order the engine applies before the forward pass, with copy-on-write's copies); the source is
  pinned until the step's orders are drained, so no allocation of the same step evicts it.

Either way the ``m`` tokens count as a prefix hit, and the rest of the block is computed.

The indexed blocks are the cached full blocks and, as TensorRT-LLM keeps them, the **partly
filled last blocks of freed sequences** (``keep_tail``): a conversation's next turn repeats the
previous turn's prompt and answer, whose KV ends inside that block. A kept tail is a cached
block under a key no block chain holds (hash of parent, tokens and a mark), evicted like any
other, never offered to a lower tier, and only ever claimed (nothing else holds it).

**The index: a per-block token trie, flattened** (``sibling_index.py``). For each parent hash
(the chained hash of a block, or a tenant's root) it keeps the token ids of the indexed blocks
that follow it, as byte strings in sorted order; a lookup is one ``bisect`` and two
binary-searched comparisons, O(log children + log B), whatever ``U``. Chosen over chained
hashes per unit because those cost ``B / U`` hashes and index entries per block (128 per
block at ``U = 1``, ``B = 128``) on every prompt, whereas this index costs one entry of at most
``4B`` bytes per indexed block, is touched only where a match stops, answers every ``U`` at
once, and takes a partly filled tail as it is. The block-chain hashes, their index and their
events stay exactly those of ``U = B``.

**What is never reused partially.** A block computed in the current step (its KV is written by
the forward pass, after the step's copies): ``fresh`` blocks are not sources until the next
step. A block whose tokens carry multimodal spans (its KV depends on more than its token ids),
and a prompt block with spans. Lower tiers (host, store) return whole blocks only
(``docs/prefix_cache.md`` says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pagedkv.kvcache.allocator_base import SeqBlocks
from pagedkv.kvcache.block_pool import BlockPool
from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash, HashExtraKeys, HashFn, token_bytes
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike
from pagedkv.kvcache.sibling_index import SiblingIndex
from pagedkv.kvcache.tiers.contract import PrefixCopy


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
    hash_fn: HashFn
    index: SiblingIndex = field(default_factory=SiblingIndex)
    tails: set[BlockHash] = field(default_factory=set)  # the kept tails' keys (see keep_tail)
    counters: PartialCounters = field(default_factory=PartialCounters)
    fresh: set[int] = field(default_factory=set)  # blocks hashed this step (KV not yet written)
    pins: list[int] = field(default_factory=list)  # copy sources held until the step ends
    copies: list[PrefixCopy] = field(default_factory=list)
    plan: _Plan | None = None

    def __post_init__(self) -> None:
        self.pool.on_unindex = self._unindexed

    def _unindexed(self, block_hash: BlockHash) -> None:
        self.index.remove(block_hash)
        self.tails.discard(block_hash)

    def keep_tail(
        self, seq: SeqLike, st: SeqBlocks, root: BlockHash, events: KVEventLog | None
    ) -> bool:
        """``seq`` is being freed: keep its partly filled last block reusable. It is indexed
        (and cached, evictable like any cached block) under a key of its own, the hash of its
        parent, its known tokens and ``_TAIL_MARK``, which no full block's chain ever holds,
        so only a partial match finds it (and always claims it: no one else holds it). Not
        offered to lower tiers (``offered``). True when kept: the block now holds that key."""
        bs, num_full = self.pool.block_size, len(st.block_hashes)
        start, end = num_full * bs, min(st.num_tokens, seq.num_known_tokens)
        tail = st.block_ids[-1]
        one_partial_tail = len(st.block_ids) == num_full + 1 and end - start >= self.unit
        if not one_partial_tail or self.pool.ref_counts[tail] != 1:
            return False
        if _has_spans(seq.extra_keys, start, end):
            return False
        parent = st.block_hashes[-1] if num_full else root
        tokens = token_bytes(seq.token_ids[start:end])
        key = self.hash_fn(parent + tokens + _TAIL_MARK)
        if self.pool.set_hash(tail, key) and events is not None:  # new to the index
            event_parent = st.block_hashes[-1] if num_full else None
            lora, tail_tokens = seq.extra_keys.lora_id, seq.token_ids[start:end]
            events.stored([key], event_parent, bs, lora, token_ids=tail_tokens)
        self.index.add(parent, key, tokens)
        self.tails.add(key)
        return True

    def offered(self, block_hash: BlockHash) -> bool:
        """Whether an evicted block's hash may go to a lower tier (a kept tail's key may not:
        the tiers serve whole blocks of a chain)."""
        return block_hash not in self.tails

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


# Ends a kept tail's key (``keep_tail``): a full block's hash input ends with its token bytes
# (a multiple of 4) or multimodal spans, never with this.
_TAIL_MARK = b"\x00pagedkv-partial-tail"


def _has_spans(extra: HashExtraKeys, start: int, end: int) -> bool:
    return any(s.offset < end and s.offset + s.length > start for s in extra.mm_spans)


def check_prefix_match_unit(unit: int, block_size: int | None = None) -> None:
    """ValueError unless ``unit`` is a whole number of tokens >= 1 (dividing ``block_size``
    when given)."""
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValueError(f"the prefix match unit must be an integer >= 1 token, got {unit!r}")
    if block_size is not None and block_size % unit:
        raise ValueError(
            f"the prefix match unit ({unit} tokens) must divide the block size ({block_size})"
        )
