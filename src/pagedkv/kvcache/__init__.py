"""The paged KV cache core: block pool, block tables, prefix index and three allocators.

Pure Python: nothing here imports torch. The scheduler, the simulator and the engine all talk
to an allocator through ``KVAllocator`` (see ``protocol.py``).
"""

from pagedkv.kvcache.block_pool import NULL_BLOCK_ID, BlockPool
from pagedkv.kvcache.hashing import (
    HASH_FUNCTIONS,
    NO_EXTRA_KEYS,
    BlockHash,
    HashExtraKeys,
    MMSpan,
    hash_blocks,
    root_hash,
)
from pagedkv.kvcache.paged import PagedAllocator
from pagedkv.kvcache.policies import POLICIES, Policy, build_allocator, get_policy
from pagedkv.kvcache.protocol import KVAllocator, KVCacheStats, SeqLike
from pagedkv.kvcache.radix import RadixAllocator
from pagedkv.kvcache.reserved import ReservedAllocator
from pagedkv.kvcache.tiers.swap_space import SwapSpace

__all__ = [
    "HASH_FUNCTIONS",
    "NO_EXTRA_KEYS",
    "NULL_BLOCK_ID",
    "POLICIES",
    "BlockHash",
    "BlockPool",
    "HashExtraKeys",
    "KVAllocator",
    "KVCacheStats",
    "MMSpan",
    "PagedAllocator",
    "Policy",
    "RadixAllocator",
    "ReservedAllocator",
    "SeqLike",
    "SwapSpace",
    "build_allocator",
    "get_policy",
    "hash_blocks",
    "root_hash",
]
