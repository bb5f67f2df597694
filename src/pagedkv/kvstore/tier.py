"""``StoreTier``: the shared store as the allocator's "store" tier (``kvcache/tiers/contract.py``).

``match`` fetches the payloads of the leading hashes (MGET, a chunk at a time), verifies each
(``codec.decode_payload``: magic, version, namespace, block hash, length, CRC-32) and stops at
the first miss or rejected payload; the verified bodies are *staged*, so the engine's load only
copies bytes that already passed the checksum. A rejected payload is counted by reason, deleted
from the store (best effort; the recomputed block's write-through replaces it anyway) and its
block is recomputed. ``claim`` pins staged bodies until the engine ``take``s them; ``end_step``
drops what was staged but not claimed. Saves: ``encode`` builds the payloads of the step's
newly computed full blocks (on the writer's thread) and ``submit`` hands the bodies to it.

Pure Python; a store that is down or slow is a miss (``client.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.hashing import BlockHash
from pagedkv.kvcache.tiers.contract import TIER_STORE
from pagedkv.kvstore.client import StoreClient
from pagedkv.kvstore.codec import Rejected, decode_payload, encode_payload, store_key
from pagedkv.kvstore.counters import StoreCounters
from pagedkv.kvstore.writer import StoreWriter

log = logging.getLogger("pagedkv.kvstore")


class StoreTier:
    """``namespace``: ``namespace.store_namespace`` of this engine; ``body_bytes``: one block's
    KV in the page layout; ``block_size`` in tokens (for the hit-token counter)."""

    name = TIER_STORE
    accepts_offloads = False
    wants_saves = True
    event_medium = None  # no replica's own cache: a router learns nothing from its contents

    def enable_events(self, log: KVEventLog, block_size: int) -> None:
        """Never called (``event_medium`` is None): the store reports no events."""

    def hashes(self) -> list[BlockHash]:
        return []  # what it holds is Redis's, not this replica's

    def __init__(
        self, client: StoreClient, namespace: bytes, body_bytes: int, block_size: int
    ) -> None:
        self.client = client
        self.writer = StoreWriter(client, self.encode)
        self.counters: StoreCounters = client.counters
        self.namespace = namespace
        self.body_bytes = body_bytes
        self.block_size = block_size
        self._staged: dict[BlockHash, memoryview] = {}  # verified, not claimed yet
        self._claimed: dict[BlockHash, memoryview] = {}  # claimed, not taken by the engine yet
        self._logged_reject = False

    def key(self, block_hash: BlockHash) -> bytes:
        return store_key(self.namespace, block_hash)

    # -- the tier protocol -----------------------------------------------------------------

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(block_hashes) and (
            block_hashes[n] in self._staged or block_hashes[n] in self._claimed
        ):
            n += 1  # verified earlier in this step (another sequence with the same prefix)
        rest = block_hashes[n:]
        if not rest:
            return n
        payloads = self.client.get_run([self.key(h) for h in rest])
        # payloads may be shorter than rest: a miss ends the run
        for h, payload in zip(rest, payloads, strict=False):
            body = decode_payload(payload, self.namespace, h, self.body_bytes)
            if isinstance(body, Rejected):
                self._reject(h, body)
                break
            self._staged[h] = body
            n += 1
        return n

    def claim(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            body = self._staged.pop(h, None)
            if body is None:
                body = self._claimed.get(h)
            if body is None:
                raise ValueError(f"store tier: block {h.hex()[:16]} was not matched this step")
            self._claimed[h] = body
        self.counters.add(
            hit_blocks=len(block_hashes), hit_tokens=len(block_hashes) * self.block_size
        )

    def offer(self, block_hash: BlockHash) -> bool:
        return False  # a write-through store already has every block it can get

    def end_step(self) -> None:
        self._staged.clear()

    # -- the engine's side -----------------------------------------------------------------

    def take(self, block_hashes: Sequence[BlockHash]) -> list[memoryview]:
        """The verified bodies of claimed blocks, in order; they are forgotten here."""
        bodies = [self._claimed[h] for h in block_hashes]
        for h in set(block_hashes):
            del self._claimed[h]
        return bodies

    def encode(self, block_hash: BlockHash, body: bytes | memoryview) -> tuple[bytes, bytes]:
        """``(key, payload)`` of one block computed here."""
        return self.key(block_hash), encode_payload(self.namespace, block_hash, body)

    def submit(self, items: Sequence[tuple[BlockHash, memoryview]]) -> int:
        """Write-through of ``(block hash, body)`` pairs, encoded and sent on the background
        thread; returns how many were queued. The bodies must not change afterwards."""
        return self.writer.submit(items)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted write was sent (tests, benchmarks, shutdown)."""
        return self.writer.flush(timeout_s)

    def close(self) -> None:
        self.writer.close()
        self.client.close()

    def describe(self) -> str:
        """The start-up line's text."""
        return (
            f"KV store tier {self.client.address.url}: namespace {self.namespace.hex()}, "
            f"{self.body_bytes} bytes per block, write-through of every computed full block"
        )

    def _reject(self, block_hash: BlockHash, why: Rejected) -> None:
        self.counters.reject(why.reason)
        if not self._logged_reject:
            log.warning(
                "KV store %s: rejected a payload (%s: %s); the block is recomputed (further "
                "rejections are counted, not logged)",
                self.client.address.url,
                why.reason,
                why.detail,
            )
            self._logged_reject = True
        self.client.delete(self.key(block_hash))
