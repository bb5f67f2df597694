"""Chained block hashes: the identity of a full block of KV for prefix caching.

The hash of block ``i`` covers the hash of block ``i - 1`` (the parent), the block's token ids
and the extra keys that change what the KV means: a LoRA/adapter id and a ``cache_salt`` (both
folded into the root of the chain, so they reach every block) and the multimodal spans that
overlap the block. Two sequences therefore share block ``i`` only if they agree on every token
before it and on all of those keys.

Hashes are stable across processes (never Python's salted ``hash()``): the default is sha256,
collision-resistant; ``blake2b`` is the same strength, and ``xxh3_128`` (when the ``xxhash``
package is installed) is faster but not collision-resistant.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

# Token ids are serialised as little-endian unsigned 32-bit integers.
_TOKEN_TYPECODE = "I"
_TOKEN_BYTES = 4
_GROUP_TOKENS = 2048  # tokens serialised per C-level call in hash_blocks (8 KiB)


@dataclass(frozen=True)
class MMSpan:
    """A multimodal input placed at token positions ``[offset, offset + length)``."""

    content_hash: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"multimodal span needs offset >= 0 and length >= 1, got {self}")


@dataclass(frozen=True)
class HashExtraKeys:
    """Keys besides token ids that decide whether two sequences may share KV."""

    lora_id: str | None = None
    cache_salt: str | None = None
    mm_spans: tuple[MMSpan, ...] = ()


NO_EXTRA_KEYS = HashExtraKeys()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional dependency, imported only when asked for

    return xxhash.xxh3_128_digest(data)


# The block hash every allocator uses unless told otherwise; the engine's store keys, its KV
# events and a router's index name it, so they all read this one constant.
DEFAULT_HASH_ALGORITHM = "sha256"

HASH_FUNCTIONS: dict[str, HashFn] = {
    DEFAULT_HASH_ALGORITHM: _sha256,
    "blake2b": _blake2b,
    "xxh3_128": _xxh3_128,
}


def get_hash_fn(name: str) -> HashFn:
    """The hash function called ``name``; ValueError names the choices."""
    try:
        fn = HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown block hash {name!r}; choose one of {', '.join(HASH_FUNCTIONS)}"
        ) from None
    if name == "xxh3_128":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise ValueError("block hash 'xxh3_128' needs `pip install xxhash`") from None
    return fn


def root_hash(extra: HashExtraKeys, hash_fn: HashFn = _sha256) -> BlockHash:
    """The parent hash of block 0: salt and LoRA id live here, so they reach every block."""
    seed = f"pagedkv-v1\x00lora={extra.lora_id!r}\x00salt={extra.cache_salt!r}".encode()
    return hash_fn(seed)


class RootHashes:
    """``root_hash`` by extra keys, cached: one hash per tenant salt and LoRA id, recomputed
    only after the cache (bounded: a server with per-user salts meets many) was cleared."""

    def __init__(self, hash_fn: HashFn = _sha256, max_entries: int = 4096) -> None:
        self._hash_fn, self._max_entries = hash_fn, max_entries
        self._roots: dict[HashExtraKeys, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._roots)

    def __call__(self, extra: HashExtraKeys) -> BlockHash:
        root = self._roots.get(extra)
        if root is None:
            if len(self._roots) >= self._max_entries:
                self._roots.clear()
            root = self._roots[extra] = root_hash(extra, self._hash_fn)
        return root


def mm_span_bytes(spans: tuple[MMSpan, ...], start: int, end: int) -> bytes:
    """The spans overlapping token positions ``[start, end)``, as bytes (empty if none)."""
    parts = [
        f"{s.content_hash}@{s.offset}+{s.length}"
        for s in spans
        if s.offset < end and s.offset + s.length > start
    ]
    return ("\x00mm:" + ";".join(parts)).encode() if parts else b""


@functools.lru_cache(maxsize=512)
def _token_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}{_TOKEN_TYPECODE}")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The serialised token ids, ``_TOKEN_BYTES`` per token (ValueError on a negative id)."""
    if isinstance(token_ids, array) and token_ids.typecode == _TOKEN_TYPECODE:
        if sys.byteorder == "little":
            return token_ids.tobytes()  # already in the wire layout (sched.Sequence keeps this)
        token_ids = token_ids.tolist()
    # A compiled Struct packs a list about twice as fast as array(...).tobytes() (and 2x
    # faster than struct.pack with a format string), and its "<" pins the byte order.
    try:
        return _token_struct(len(token_ids)).pack(*token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash,
    first_block: int = 0,
    num_blocks: int | None = None,
    extra: HashExtraKeys = NO_EXTRA_KEYS,
    hash_fn: HashFn = _sha256,
) -> list[BlockHash]:
    """Chained hashes of full blocks ``first_block, first_block + 1, ...`` of ``token_ids``.

    ``parent`` is the hash of block ``first_block - 1`` (or ``root_hash(extra)`` for block 0).
    Stops at ``num_blocks`` blocks or at the last full block, whichever is first. A block's
    hash input is its parent hash, ``token_bytes`` of its tokens, then its multimodal spans.
    """
    total_full = len(token_ids) // block_size
    stop = total_full if num_blocks is None else min(total_full, first_block + num_blocks)
    if stop <= first_block:
        return []
    spans = extra.mm_spans
    hashes: list[BlockHash] = []
    append = hashes.append
    stride = block_size * _TOKEN_BYTES
    # Serialise a group of blocks at a time: one C-level pack per group, and the group's bytes
    # are still in the CPU cache when hashed (packing a whole long prompt first is 1.3-1.5x
    # slower at B=128; packing block by block is slower at small B).
    group = max(1, _GROUP_TOKENS // block_size)
    sha256 = hashlib.sha256 if hash_fn is _sha256 else None  # the default, without a wrapper
    for g0 in range(first_block, stop, group):
        g1 = min(g0 + group, stop)
        buf = token_bytes(token_ids[g0 * block_size : g1 * block_size])
        for i in range(0, (g1 - g0) * stride, stride):
            chunk = buf[i : i + stride]
            if spans:
                lo = g0 * block_size + i // _TOKEN_BYTES
                chunk += mm_span_bytes(spans, lo, lo + block_size)
            parent = sha256(parent + chunk).digest() if sha256 else hash_fn(parent + chunk)
            append(parent)
    return hashes
