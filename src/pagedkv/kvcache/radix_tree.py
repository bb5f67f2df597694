"""A radix tree over pages of token ids: the prefix index of ``RadixAllocator``.

Each edge holds a run of whole pages: ``node.keys[i]`` is the key of one page (the token id at
page size 1, the page's token tuple otherwise, plus any multimodal span overlapping it) and
``node.pages[i]`` the physical page holding its KV. Runs are split when a sequence diverges or
is admitted in the middle of one, so every live sequence holds whole nodes along a root path.

The tree reads page reference counts (``ref_counts``, owned by the allocator) but never changes
them: a node is *locked* while its pages are referenced, and only unlocked leaves are evicted,
least recently used first. Because a locked node's ancestors are locked too, every unlocked
page is reachable by evicting leaves.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

from pagedkv.kvcache.hashing import HashExtraKeys, mm_span_bytes

PageKey = object


def page_keys(
    tokens: Sequence[int], page_size: int, first: int, stop: int, extra: HashExtraKeys
) -> list:
    """Tree keys of pages ``[first, stop)`` of ``tokens``: the token id itself at page size 1,
    else the page's tokens as a tuple; a multimodal span overlapping a page joins its key."""
    window = tokens[first * page_size : stop * page_size]
    keys: list = (
        list(window) if page_size == 1 else list(zip(*[iter(window)] * page_size, strict=False))
    )
    if extra.mm_spans:
        for j in range(len(keys)):
            lo = (first + j) * page_size
            mm = mm_span_bytes(extra.mm_spans, lo, lo + page_size)
            if mm:
                keys[j] = (keys[j], mm)
    return keys


class RadixNode:
    __slots__ = ("keys", "pages", "parent", "children", "last_access")

    def __init__(self, keys: tuple, pages: list[int], parent: RadixNode | None) -> None:
        self.keys = keys
        self.pages = pages
        self.parent = parent
        self.children: dict[PageKey, RadixNode] = {}
        self.last_access = 0


class RadixTree:
    """Nodes, the page -> node map and the LRU heap of eviction candidates."""

    def __init__(self, ref_counts: list[int]) -> None:
        self._refs = ref_counts
        self.node_of_page: dict[int, RadixNode] = {}
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tiebreak = count()

    @staticmethod
    def new_root() -> RadixNode:
        return RadixNode((), [], None)

    # -- lookup ----------------------------------------------------------------------------

    @staticmethod
    def match(root: RadixNode, keys: Sequence[PageKey]) -> list[tuple[RadixNode, int]]:
        """The longest prefix of ``keys`` in the tree, as (node, pages matched in it) along the
        path; only the last node may be matched partly. Mutates nothing."""
        path: list[tuple[RadixNode, int]] = []
        node, i, n = root, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.keys
            m = min(len(ck), n - i)
            if ck[:m] != tuple(keys[i : i + m]):  # rare: find where the run diverges
                m = next(j for j in range(1, m) if ck[j] != keys[i + j])
            path.append((child, m))
            i += m
            if m < len(ck):
                break
            node = child
        return path

    def split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper part. ``node`` keeps
        the lower part (and its identity, so a sequence whose deepest node it is keeps it)."""
        assert node.parent is not None and 0 < num_pages < len(node.keys)
        upper = RadixNode(node.keys[:num_pages], node.pages[:num_pages], node.parent)
        upper.last_access = node.last_access
        node.parent.children[node.keys[0]] = upper
        node.keys, node.pages = node.keys[num_pages:], node.pages[num_pages:]
        node.parent = upper
        upper.children[node.keys[0]] = node
        for p in upper.pages:
            self.node_of_page[p] = upper
        return upper

    def add_pages(self, parent: RadixNode, keys: Sequence[PageKey], pages: list[int]) -> RadixNode:
        """Add ``pages`` (keyed by ``keys``) under ``parent`` as one node per run of equal
        reference count (pages shared with forked siblings come first), so that a node is locked
        or free as a whole. Returns the deepest node added."""
        refs, start = self._refs, 0
        for end in range(1, len(pages) + 1):
            if end == len(pages) or refs[pages[end]] != refs[pages[start]]:
                parent = self._add_child(parent, tuple(keys[start:end]), pages[start:end])
                start = end
        return parent

    def _add_child(self, parent: RadixNode, keys: tuple, pages: list[int]) -> RadixNode:
        """One node of ``pages`` under ``parent``, mapped page by page."""
        node = RadixNode(keys, pages, parent)
        parent.children[keys[0]] = node
        for p in pages:
            self.node_of_page[p] = node
        return node

    # -- eviction --------------------------------------------------------------------------

    def is_locked(self, node: RadixNode) -> bool:
        return self._refs[node.pages[0]] > 0

    def offer(self, node: RadixNode) -> None:
        """Note that ``node`` may have become an evictable leaf (checked again when popped)."""
        if node.parent is not None and not node.children and not self.is_locked(node):
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def evict(self, num_pages: int) -> list[int]:
        """Free at least ``num_pages`` unlocked pages, least recently used leaves first, taking
        only the tail of the last leaf when it holds more than needed. Returns the pages; the
        caller must have checked that enough are unlocked."""
        out: list[int] = []
        while len(out) < num_pages:
            access, _, node = heapq.heappop(self._heap)
            if (
                node.parent is None
                or node.children
                or self.is_locked(node)
                or node.last_access != access
                or self.node_of_page.get(node.pages[0]) is not node
            ):
                continue  # stale entry: re-offered when it becomes a free leaf again
            take = min(len(node.pages), num_pages - len(out))
            if take < len(node.pages):  # keep the head of the run cached
                cut = len(node.pages) - take
                gone = node.pages[cut:]
                node.keys, node.pages = node.keys[:cut], node.pages[:cut]
                heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))
            else:
                gone = node.pages
                parent = node.parent
                del parent.children[node.keys[0]]
                node.parent = None
                # A parent was used whenever its child was: it inherits the later access time.
                parent.last_access = max(parent.last_access, node.last_access)
                self.offer(parent)
            for p in gone:
                del self.node_of_page[p]
            out.extend(gone)
        return out

    # -- checks ----------------------------------------------------------------------------

    def check(self, roots: Sequence[RadixNode]) -> int:
        """Assert the tree's structure; returns the number of unlocked (evictable) pages."""
        refs, unlocked, seen = self._refs, 0, 0
        stack = [c for r in roots for c in r.children.values()]
        while stack:
            node = stack.pop()
            assert node.pages and len(node.keys) == len(node.pages), "empty or ragged node"
            assert node.parent is not None and node.parent.children.get(node.keys[0]) is node
            rc = refs[node.pages[0]]
            assert all(refs[p] == rc for p in node.pages), "a node's pages disagree on locks"
            if rc > 0 and node.parent.parent is not None:
                assert self.is_locked(node.parent), "a locked node under an unlocked one"
            for p in node.pages:
                assert self.node_of_page.get(p) is node, f"page {p} not mapped to its node"
            unlocked += 0 if rc else len(node.pages)
            seen += len(node.pages)
            stack.extend(node.children.values())
        assert seen == len(self.node_of_page), "a mapped page is not in the tree"
        return unlocked
