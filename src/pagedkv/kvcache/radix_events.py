"""``PageHashes``: the KV events of ``RadixAllocator``.

The radix tree keys pages by their tokens; a router names blocks by chained hashes. So each page
that enters the tree gets the hash a ``PagedAllocator`` of the same block size would give the
same tokens (``hash_blocks``, sha256, one block per page), kept here until the page leaves the
tree, and both moves are reported to a ``KVEventLog``.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash, hash_blocks, root_hash
from pagedkv.kvcache.protocol import SeqLike


class PageHashes:
    """Page -> chained hash of every page in the tree; mutated by the allocator's thread."""

    def __init__(self, log: KVEventLog, page_size: int) -> None:
        self.log, self.page_size = log, page_size
        self.of_page: dict[int, BlockHash] = {}

    def stored(self, seq: SeqLike, parent_page: int | None, first: int, pages: list[int]) -> None:
        """``pages`` hold pages ``first, first + 1, ...`` of ``seq`` and hang under the tree
        page ``parent_page`` (None: under a root)."""
        extra = seq.extra_keys
        parent = self.of_page[parent_page] if parent_page is not None else None
        hashes = hash_blocks(
            seq.token_ids, self.page_size, parent or root_hash(extra), first, len(pages), extra
        )
        self.of_page.update(zip(pages, hashes, strict=True))
        self.log.stored(hashes, parent, self.page_size, extra.lora_id)

    def removed(self, pages: Iterable[int]) -> None:
        """``pages`` left the tree (evicted)."""
        for p in pages:
            self.log.removed(self.of_page.pop(p))
