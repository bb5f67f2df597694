"""The store's key and payload format: one Redis value per full block of KV.

Key: ``pagedkv:kv:<namespace>:<chained block hash, hex>``. The namespace is a digest of the
page format (``pages.page_format.PageFormat``: block size, attention kind, KV dtype, layers, KV heads,
head dim, record bytes) and the model's identity (``kvstore.namespace``), so two engines share
a key only when a block of one means exactly the same bytes to the other. The chained block
hash already covers ``cache_salt``, the LoRA id and multimodal spans (``kvcache.hashing``).

Value (little-endian)::

    magic     6 bytes  b"PKVBLK"
    version   u16      1
    namespace 16 bytes the key's namespace (raw)
    hash_len  u16      length of the block hash
    hash      bytes    the chained block hash (raw)
    body_len  u64      length of the body in bytes
    checksum  u32      CRC-32 of the body (zlib)
    body      bytes    the block's raw KV in the page layout (see ``engine/kv/block_copy.py``)

``decode_payload`` never raises on bad bytes: it returns a ``Rejected`` naming the reason
(``truncated``, ``bad_magic``, ``bad_version``, ``foreign_format``, ``wrong_hash``,
``bad_length``, ``bad_checksum``). Pure Python: no torch here.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"PKVBLK"
VERSION = 1
NAMESPACE_BYTES = 16
KEY_PREFIX = "pagedkv:kv:"
_HEAD = struct.Struct(f"<{len(MAGIC)}sH{NAMESPACE_BYTES}sH")  # magic, version, ns, hash_len
_TAIL = struct.Struct("<QI")  # body_len, CRC-32 of the body

REJECT_REASONS = (
    "truncated",
    "bad_magic",
    "bad_version",
    "foreign_format",
    "wrong_hash",
    "bad_length",
    "bad_checksum",
)


@dataclass(frozen=True)
class Rejected:
    """Why a payload was refused (one of ``REJECT_REASONS``) and a readable detail."""

    reason: str
    detail: str


def checksum(body: bytes | memoryview) -> int:
    """CRC-32 of the body: it catches every flipped byte and burst (this guards against
    corruption and truncation, not an adversary: who can write to the store can write KV),
    and runs ~5x faster than blake2b here (28 vs 145 ms for a 1,500-token prompt's 68 MB)."""
    return zlib.crc32(body)


def store_key(namespace: bytes, block_hash: bytes) -> bytes:
    """The Redis key of one block: ``pagedkv:kv:<namespace hex>:<block hash hex>``."""
    return f"{KEY_PREFIX}{namespace.hex()}:{block_hash.hex()}".encode()


def encode_payload(namespace: bytes, block_hash: bytes, body: bytes | memoryview) -> bytes:
    """Header + ``body``. ValueError if the namespace is not ``NAMESPACE_BYTES`` long."""
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    head = _HEAD.pack(MAGIC, VERSION, namespace, len(block_hash))
    return b"".join((head, block_hash, _TAIL.pack(len(body), checksum(body)), body))


def decode_payload(
    payload: bytes, namespace: bytes, block_hash: bytes, body_bytes: int
) -> memoryview | Rejected:
    """The body of ``payload`` (a view into it) if it is a version-1 block of ``namespace``
    and ``block_hash``, exactly ``body_bytes`` long, whose checksum matches; else a
    ``Rejected``. Never raises for any bytes."""
    view = memoryview(payload)
    if len(view) < _HEAD.size:
        return Rejected("truncated", f"{len(view)} bytes, shorter than the header")
    magic, version, ns, hash_len = _HEAD.unpack_from(view)
    if magic != MAGIC:
        return Rejected("bad_magic", f"magic {bytes(magic)!r}")
    if version != VERSION:
        return Rejected("bad_version", f"version {version}, this engine reads {VERSION}")
    if ns != namespace:
        return Rejected("foreign_format", f"namespace {ns.hex()} here {namespace.hex()}")
    start = _HEAD.size + hash_len + _TAIL.size
    if len(view) < start:
        return Rejected("truncated", f"{len(view)} bytes, shorter than the header")
    if view[_HEAD.size : _HEAD.size + hash_len] != block_hash:
        return Rejected("wrong_hash", "the payload names another block hash")
    body_len, digest = _TAIL.unpack_from(view, _HEAD.size + hash_len)
    if body_len != body_bytes:
        return Rejected("bad_length", f"body of {body_len} bytes, a block here is {body_bytes}")
    body = view[start:]
    if len(body) != body_len:
        return Rejected("truncated", f"body of {len(body)} bytes, header says {body_len}")
    if checksum(body) != digest:
        return Rejected("bad_checksum", "the body's CRC-32 does not match the header")
    return body
