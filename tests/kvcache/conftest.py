"""Shared fixtures for the KV cache tests: a minimal sequence and one factory per allocator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pagedkv.kvcache import (
    NO_EXTRA_KEYS,
    HashExtraKeys,
    KVAllocator,
    PagedAllocator,
    RadixAllocator,
    ReservedAllocator,
)


@dataclass
class Seq:
    """The smallest thing that satisfies ``SeqLike``."""

    seq_id: int
    token_ids: list[int]
    extra_keys: HashExtraKeys = field(default=NO_EXTRA_KEYS)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)


def admit(alloc: KVAllocator, seq: Seq) -> int:
    """Admit ``seq`` with its whole prompt, as the scheduler does; returns the prefix hit."""
    hit = alloc.match_prefix(seq)
    assert alloc.allocate(seq, len(seq.token_ids) - hit, num_cached_tokens=hit)
    return hit


# Each factory gets a pool size in token slots and returns an allocator over it.
FACTORIES: dict[str, Callable[[int], KVAllocator]] = {
    "paged16": lambda slots: PagedAllocator(slots // 16, 16),
    "paged1": lambda slots: PagedAllocator(slots, 1),
    "paged16-nocache": lambda slots: PagedAllocator(slots // 16, 16, prefix_caching=False),
    # Partial-block reuse: prefix matches in units of 1 and 4 tokens inside the blocks.
    "paged16-u1": lambda slots: PagedAllocator(slots // 16, 16, prefix_match_unit=1),
    "paged8-u4": lambda slots: PagedAllocator(slots // 8, 8, prefix_match_unit=4),
    "radix1": lambda slots: RadixAllocator(slots, page_size=1),
    "radix16": lambda slots: RadixAllocator(slots, page_size=16),
    "reserved": lambda slots: ReservedAllocator(slots, max_model_len=256),
}


@pytest.fixture(params=list(FACTORIES))
def make_alloc(request) -> Callable[[int], KVAllocator]:
    return FACTORIES[request.param]
