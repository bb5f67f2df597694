"""``RadixAllocator``: SGLang-style prefix sharing over a radix tree of token ids.

The pool is cut into pages of ``page_size`` slots (``page_size=1``: reuse at any token). The
prefix index is a radix tree (``radix_tree.py``) whose edges are runs of full pages, with a root
per (LoRA id, cache salt) to keep tenants apart. As in SGLang, a sequence's full pages enter the
tree at the end of each prompt chunk and when it is freed (finished or preempted), not at every
decode token; a page whose prefix is already in the tree is swapped for the tree's copy (same
tokens after the same prefix, hence the same KV) and the duplicate is freed.

A node's lock count is the reference count of its pages: the number of live sequences whose
block table holds them. Eviction takes the least recently used unlocked leaf first and never
strands a descendant (unlike the hash-chain index, where evicting a head block leaves its cached
tail unreachable).
"""

from __future__ import annotations

from pagedkv.kvcache.allocator_base import BlockTableAllocator, SeqBlocks, ceil_div
from pagedkv.kvcache.block_pool import NULL_BLOCK_ID
from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash, HashExtraKeys
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike
from pagedkv.kvcache.radix_events import PageHashes
from pagedkv.kvcache.radix_tree import RadixNode, RadixTree, page_keys


class RadixAllocator(BlockTableAllocator):
    """``num_slots // page_size`` pages; page 0 is the null page."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if not isinstance(num_slots, int) or num_slots // page_size < 2:
            raise ValueError(f"num_slots={num_slots!r} must hold at least 2 pages of {page_size}")
        super().__init__(page_size)
        self.num_pages = num_slots // page_size
        self.ref_counts = [0] * self.num_pages
        self.ref_counts[NULL_BLOCK_ID] = 1
        self._free_pages = list(range(self.num_pages - 1, 0, -1))  # a stack, lowest on top
        self.tree = RadixTree(self.ref_counts)
        self._roots: dict[tuple[str | None, str | None], RadixNode] = {}
        self._clock = 0
        self.num_evictable = 0  # tree pages with ref_count 0
        self.num_evictions = 0
        self.events: PageHashes | None = None  # KV events (``enable_events``)

    def enable_events(self, log: KVEventLog) -> None:
        """Report pages entering and leaving the tree to ``log`` as chained block hashes
        (sha256, one block per page). Call before the first admission."""
        if self.tree.node_of_page:
            raise ValueError("enable KV events before the first admission")
        self.events = PageHashes(log, self._block_size)
        log.cleared()

    def prefix_hashes(self) -> set[BlockHash]:
        return set(self.events.of_page.values()) if self.events is not None else set()

    @property
    def num_total_blocks(self) -> int:
        return self.num_pages - 1

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free_pages) + self.num_evictable

    # -- keys and lookup -------------------------------------------------------------------

    def _root(self, extra: HashExtraKeys) -> RadixNode:
        key = (extra.lora_id, extra.cache_salt)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) > 64 + 2 * len(self._seqs):
                self._prune_roots()
            root = self._roots[key] = RadixTree.new_root()
        return root

    def _prune_roots(self) -> None:
        """Drop the roots of tenants with nothing cached and no live sequence (a server with
        per-user salts would otherwise keep one per user forever)."""
        held = {id(st.tree_node) for st in self._seqs.values()}
        self._roots = {k: r for k, r in self._roots.items() if r.children or id(r) in held}

    def _match(self, seq: SeqLike, max_pages: int) -> list[tuple[RadixNode, int]]:
        keys = page_keys(seq.token_ids, self._block_size, 0, max_pages, seq.extra_keys)
        return self.tree.match(self._root(seq.extra_keys), keys)

    def match_prefix(self, seq: SeqLike) -> int:
        if seq.seq_id in self._seqs:
            return 0
        max_pages = (len(seq.token_ids) - 1) // self._block_size
        return sum(m for _, m in self._match(seq, max_pages)) * self._block_size

    # -- pages -----------------------------------------------------------------------------

    def _take(self, num_pages: int) -> list[int]:
        short = num_pages - len(self._free_pages)
        if short > 0:
            evicted = self.tree.evict(short)
            if self.events is not None:
                self.events.removed(evicted)
            self.num_evictable -= len(evicted)
            self.num_evictions += len(evicted)
            self._free_pages.extend(evicted)
        out = [self._free_pages.pop() for _ in range(num_pages)]
        for p in out:
            self.ref_counts[p] = 1
        return out

    def _lock(self, node: RadixNode) -> None:
        refs = self.ref_counts
        if refs[node.pages[0]] == 0:
            self.num_evictable -= len(node.pages)
        for p in node.pages:
            refs[p] += 1

    def _release(self, page: int) -> None:
        refs = self.ref_counts
        refs[page] -= 1
        if refs[page] == 0:
            if page in self.tree.node_of_page:
                self.num_evictable += 1
            else:
                self._free_pages.append(page)

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        self._check_count("num_new_tokens", num_new_tokens)
        self._check_count("num_cached_tokens", num_cached_tokens)
        ps = self._block_size
        st = self._seqs.get(seq.seq_id)
        if st is not None and num_cached_tokens:
            raise ValueError(f"sequence {seq.seq_id} is already admitted; num_cached_tokens=0")
        total = (st.num_tokens if st is not None else num_cached_tokens) + num_new_tokens
        self._check_known_tokens(seq, total)
        if st is not None:
            need = ceil_div(total, ps) - len(st.block_ids)
            if need > self.num_allocatable_blocks:
                return False
            if need > 0:
                st.block_ids.extend(self._take(need))
            st.num_tokens = total
            if num_new_tokens > 1:  # the end of a prompt chunk: share it
                self._insert(seq, st, dedup=False)
            return True
        return self._admit(seq, num_new_tokens, num_cached_tokens)

    def _admit(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int) -> bool:
        self._check_new(seq)
        ps = self._block_size
        if num_cached_tokens % ps or (
            num_cached_tokens and num_cached_tokens >= len(seq.token_ids)
        ):
            raise ValueError(
                f"num_cached_tokens={num_cached_tokens} must be a multiple of page_size={ps} "
                "below the number of tokens, as returned by match_prefix"
            )
        hit_pages = num_cached_tokens // ps
        path = self._match(seq, hit_pages)
        if sum(m for _, m in path) != hit_pages:
            raise ValueError(f"sequence {seq.seq_id}: the prefix match is stale")
        total = num_cached_tokens + num_new_tokens
        need = ceil_div(total, ps) - hit_pages
        revived = sum(m for node, m in path if not self.tree.is_locked(node))
        if need + revived > self.num_allocatable_blocks:
            return False
        nodes = [node for node, _ in path]
        if path and path[-1][1] < len(path[-1][0].keys):  # admitted mid-run: cut the run there
            nodes[-1] = self.tree.split(path[-1][0], path[-1][1])
        for node in nodes:
            self._lock(node)  # before taking pages, so that eviction cannot reach the path
        st = SeqBlocks([p for node in nodes for p in node.pages], total)
        st.tree_node = nodes[-1] if nodes else self._root(seq.extra_keys)
        st.tree_depth = hit_pages
        self._clock += 1
        st.tree_node.last_access = self._clock
        if need > 0:
            st.block_ids.extend(self._take(need))
        self._seqs[seq.seq_id] = st
        self._prefix.query_tokens += len(seq.token_ids)
        self._prefix.hit_tokens += num_cached_tokens
        if num_new_tokens > 1:
            self._insert(seq, st, dedup=False)
        return True

    def _insert(self, seq: SeqLike, st: SeqBlocks, dedup: bool) -> None:
        """Enter ``st``'s full pages beyond its tree path into the tree.

        Where the tree already holds the same tokens in other pages, a running sequence stops
        (its pages stay private: the other copy may not be computed yet, and two sequences must
        never write one slot); a sequence being freed (``dedup``) switches to the tree's pages
        and releases its duplicates instead."""
        # A placeholder (a token scheduled before it was sampled) enters once it is known.
        first = st.tree_depth
        num_full = min(st.num_tokens, seq.num_known_tokens) // self._block_size
        if num_full <= first:
            return
        keys = page_keys(seq.token_ids, self._block_size, first, num_full, seq.extra_keys)
        node = st.tree_node
        assert isinstance(node, RadixNode)
        i, switched = 0, False
        while i < len(keys):
            path = self.tree.match(node, keys[i:])
            if not path:
                pages = st.block_ids[first + i : num_full]
                if switched and self.ref_counts[pages[0]] > 1:
                    # A forked sibling still holds these pages under the pages we just swapped
                    # away: they can join the tree only under the sibling's own path.
                    break
                if self.events is not None:  # under a tree page, or a root (no pages)
                    parent_page = node.pages[-1] if node.parent is not None else None
                    self.events.stored(seq, parent_page, first + i, pages)
                node = self.tree.add_pages(node, keys[i:], pages)
                i = len(keys)
                break
            child, m = path[0]
            ours = st.block_ids[first + i : first + i + m]
            same = child.pages[:m] == ours  # shared with a forked sibling that inserted first
            if not (same or dedup):
                break
            if m < len(child.keys):
                child = self.tree.split(child, m)
            if not same:
                switched = True
                self._lock(child)
                for j, tree_page in enumerate(child.pages):
                    self._release(ours[j])
                    st.block_ids[first + i + j] = tree_page
            node, i = child, i + m
        self._clock += 1
        node.last_access = self._clock
        st.tree_node, st.tree_depth = node, first + i

    def tokens_known(self, seq: SeqLike) -> None:
        st = self._seqs.get(seq.seq_id)
        if st is not None:
            self._insert(seq, st, dedup=False)

    def free(self, seq: SeqLike, preempted: bool = False) -> None:
        st = self._state(seq)
        self._insert(seq, st, dedup=True)  # cache what it computed before giving it up
        self._pop(seq, preempted)
        for page in reversed(st.block_ids):
            self._release(page)
        node = st.tree_node
        if isinstance(node, RadixNode):
            self.tree.offer(node)

    def fork(self, parent: SeqLike, child: SeqLike) -> list[tuple[int, int]] | None:
        st = self._check_fork(parent, child)
        n = st.num_tokens
        num_full = n // self._block_size
        partial = num_full < len(st.block_ids)
        if partial and self.num_allocatable_blocks < 1:
            return None
        for page in st.block_ids[:num_full]:
            self.ref_counts[page] += 1
        new = SeqBlocks(list(st.block_ids[:num_full]), n)
        new.tree_node, new.tree_depth = st.tree_node, st.tree_depth
        copies: list[tuple[int, int]] = []
        if partial:
            (dst,) = self._take(1)
            new.block_ids.append(dst)
            copies.append((st.block_ids[-1], dst))
        self._seqs[child.seq_id] = new
        return copies

    # -- inspection ------------------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        return self._make_stats(
            self.num_pages - 1, len(self._free_pages), self.num_evictable, self.num_evictions
        )

    def check_invariants(self) -> None:
        self._check_tables(self.ref_counts)
        refs, free = self.ref_counts, set(self._free_pages)
        assert len(free) == len(self._free_pages), "a page is twice in the free list"
        assert NULL_BLOCK_ID not in free
        on_tree = self.tree.node_of_page
        for page in range(1, self.num_pages):
            assert refs[page] >= 0, f"page {page}: negative ref_count"
            assert (page in free) == (refs[page] == 0 and page not in on_tree), f"page {page}"
        assert self.tree.check(list(self._roots.values())) == self.num_evictable, "evictable"
        if self.events is not None:
            assert self.events.of_page.keys() == on_tree.keys(), "a tree page without a hash"
        for sid, st in self._seqs.items():  # a sequence's tree pages are its tree path
            node = st.tree_node
            pages: list[int] = []
            while isinstance(node, RadixNode) and node.parent is not None:
                pages[:0] = node.pages
                node = node.parent
            assert st.block_ids[: st.tree_depth] == pages, f"seq {sid}: tree path mismatch"
