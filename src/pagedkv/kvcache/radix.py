"""``RadixAllocator``: SGLang-style prefix sharing over a radix tree of token ids.

The pool is cut into pages of ``page_size`` slots (``page_size=1``: reuse at any token). The
tree is keyed by page contents: each node holds one full page, its key is that page's token ids
(plus any multimodal span overlapping it), and a root per (LoRA id, cache salt) keeps tenants
apart. A page joins the tree the moment it fills, so sequences admitted later reuse it.

A node's lock count is the reference count of its page: the number of live sequences whose
block table holds it. Because a block table is always a root path, a locked node's ancestors are
locked too, so every unlocked node is reachable by evicting leaves: eviction takes the least
recently used unlocked leaf first and never strands a descendant (unlike the hash-chain index,
where evicting a head block leaves its cached tail unreachable). Partial tail pages, and pages
whose prefix already exists in the tree under another page, stay private to their sequences.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

from pagedkv.kvcache.block_pool import NULL_BLOCK_ID
from pagedkv.kvcache.block_table import BlockTableAllocator, SeqBlocks, ceil_div
from pagedkv.kvcache.hashing import HashExtraKeys, mm_span_bytes
from pagedkv.kvcache.protocol import KVCacheStats, SeqLike


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_access")

    def __init__(self, key: tuple, page: int, parent: _Node | None) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, _Node] = {}
        self.last_access = 0


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
        self._node_of_page: dict[int, _Node] = {}
        self._roots: dict[tuple[str | None, str | None], _Node] = {}
        self._evictable: list[tuple[int, int, _Node]] = []  # heap of LRU leaf candidates
        self._tiebreak = count()
        self._clock = 0
        self.num_evictable = 0  # tree pages with ref_count 0
        self.num_evictions = 0

    @property
    def num_total_blocks(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_pages) + self.num_evictable

    # -- tree helpers ----------------------------------------------------------------------

    def _root(self, extra: HashExtraKeys) -> _Node:
        key = (extra.lora_id, extra.cache_salt)
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _Node((), NULL_BLOCK_ID, None)
        return root

    def _page_keys(
        self, tokens: Sequence[int], first: int, stop: int, extra: HashExtraKeys
    ) -> list:
        """Tree keys of pages ``[first, stop)``: the token id itself at page size 1, else the
        page's tokens as a tuple; a multimodal span overlapping a page joins its key."""
        ps = self._block_size
        window = tokens[first * ps : stop * ps]
        keys: list = list(window) if ps == 1 else list(zip(*[iter(window)] * ps, strict=False))
        if extra.mm_spans:
            for j in range(len(keys)):
                lo = (first + j) * ps
                mm = mm_span_bytes(extra.mm_spans, lo, lo + ps)
                if mm:
                    keys[j] = (keys[j], mm)
        return keys

    def _walk(self, seq: SeqLike, max_pages: int) -> list[_Node]:
        node, path = self._root(seq.extra_keys), []
        for key in self._page_keys(seq.token_ids, 0, max_pages, seq.extra_keys):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def match_prefix(self, seq: SeqLike) -> int:
        if seq.seq_id in self._seqs:
            return 0
        max_pages = (len(seq.token_ids) - 1) // self._block_size
        return len(self._walk(seq, max_pages)) * self._block_size

    # -- pages -----------------------------------------------------------------------------

    def _take(self, num_pages: int) -> list[int]:
        while len(self._free_pages) < num_pages:
            self._evict_one()
        out = [self._free_pages.pop() for _ in range(num_pages)]
        for p in out:
            self.ref_counts[p] = 1
        return out

    def _evict_one(self) -> None:
        while True:
            access, _, node = heapq.heappop(self._evictable)
            page = node.page
            if (
                self._node_of_page.get(page) is node
                and self.ref_counts[page] == 0
                and not node.children
                and node.last_access == access
            ):
                break
        parent = node.parent
        del parent.children[node.key]
        del self._node_of_page[page]
        self._free_pages.append(page)
        self.num_evictable -= 1
        self.num_evictions += 1
        if parent.parent is not None and not parent.children and self.ref_counts[parent.page] == 0:
            self._push_evictable(parent)

    def _push_evictable(self, node: _Node) -> None:
        heapq.heappush(self._evictable, (node.last_access, next(self._tiebreak), node))

    def _lock(self, path: list[_Node]) -> None:
        refs = self.ref_counts
        for node in path:
            if refs[node.page] == 0:
                self.num_evictable -= 1
            refs[node.page] += 1

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, seq: SeqLike, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        self._check_count("num_new_tokens", num_new_tokens)
        self._check_count("num_cached_tokens", num_cached_tokens)
        ps = self._block_size
        st = self._seqs.get(seq.seq_id)
        if st is not None and num_cached_tokens:
            raise ValueError(f"sequence {seq.seq_id} is already admitted; num_cached_tokens=0")
        base = st.num_tokens if st is not None else num_cached_tokens
        total = base + num_new_tokens
        self._check_known_tokens(seq, total)
        path: list[_Node] = []
        if st is None:
            self._check_new(seq)
            if num_cached_tokens % ps or (
                num_cached_tokens and num_cached_tokens >= len(seq.token_ids)
            ):
                raise ValueError(
                    f"num_cached_tokens={num_cached_tokens} must be a multiple of page_size={ps} "
                    "below the number of tokens, as returned by match_prefix"
                )
            path = self._walk(seq, num_cached_tokens // ps)
            if len(path) * ps != num_cached_tokens:
                raise ValueError(f"sequence {seq.seq_id}: the prefix match is stale")
        held = len(st.block_ids) if st is not None else len(path)
        need = ceil_div(total, ps) - held
        num_revived = sum(1 for n in path if self.ref_counts[n.page] == 0)
        if need + num_revived > self.num_free_blocks:
            return False
        if st is None:
            self._lock(path)  # before taking pages, so that eviction cannot reach the path
            st = SeqBlocks([n.page for n in path], total)
            st.tree_node = path[-1] if path else self._root(seq.extra_keys)
            st.tree_depth = len(path)
            self._seqs[seq.seq_id] = st
            self._prefix.query_tokens += len(seq.token_ids)
            self._prefix.hit_tokens += num_cached_tokens
        if need > 0:
            st.block_ids.extend(self._take(need))
        st.num_tokens = total
        self._insert_full_pages(seq, st)
        return True

    def _insert_full_pages(self, seq: SeqLike, st: SeqBlocks) -> None:
        """Enter the pages of ``st`` that filled since the last call into the tree."""
        node = st.tree_node
        assert isinstance(node, _Node)
        depth = st.tree_depth
        num_full = st.num_tokens // self._block_size
        if not st.on_tree or depth >= num_full:
            return
        self._clock += 1
        keys = self._page_keys(seq.token_ids, depth, num_full, seq.extra_keys)
        for page, key in zip(st.block_ids[depth:num_full], keys, strict=True):
            if key in node.children:  # the same prefix already lives in another page
                st.on_tree = False
                break
            child = _Node(key, page, node)
            node.children[key] = child
            self._node_of_page[page] = child
            node = child
            depth += 1
        node.last_access = self._clock
        st.tree_node, st.tree_depth = node, depth

    def free(self, seq: SeqLike, preempted: bool = False) -> None:
        st = self._pop(seq, preempted)
        self._clock += 1
        refs = self.ref_counts
        for page in reversed(st.block_ids):
            node = self._node_of_page.get(page)
            if node is not None:
                node.last_access = self._clock
            refs[page] -= 1
            if refs[page] == 0:
                if node is None:
                    self._free_pages.append(page)
                else:
                    self.num_evictable += 1
                    if not node.children:
                        self._push_evictable(node)

    def fork(self, parent: SeqLike, child: SeqLike) -> list[tuple[int, int]] | None:
        st = self._state(parent)
        self._check_new(child)
        n = st.num_tokens
        if list(child.token_ids[:n]) != list(parent.token_ids[:n]):
            raise ValueError(f"fork: child {child.seq_id} does not start with the parent's tokens")
        if child.extra_keys != parent.extra_keys:
            raise ValueError("fork: child and parent must have the same extra keys")
        num_full = n // self._block_size
        partial = num_full < len(st.block_ids)
        if partial and self.num_free_blocks < 1:
            return None
        for page in st.block_ids[:num_full]:
            self.ref_counts[page] += 1
        new = SeqBlocks(list(st.block_ids[:num_full]), n)
        new.tree_node, new.tree_depth, new.on_tree = st.tree_node, st.tree_depth, st.on_tree
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
        for page in range(1, self.num_pages):
            on_tree = page in self._node_of_page
            assert refs[page] >= 0, f"page {page}: negative ref_count"
            assert (page in free) == (refs[page] == 0 and not on_tree), f"page {page}: lost"
        evictable = sum(1 for p in self._node_of_page if refs[p] == 0)
        assert evictable == self.num_evictable, "evictable counter drifted"
        for page, node in self._node_of_page.items():
            assert node.page == page and node.parent is not None
            assert node.parent.children.get(node.key) is node, f"page {page}: detached node"
            if refs[page] > 0 and node.parent.parent is not None:
                assert refs[node.parent.page] > 0, f"page {page}: locked below an unlocked node"
