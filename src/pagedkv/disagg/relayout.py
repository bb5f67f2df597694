"""``--kv-import relayout``: re-page a prefill instance's blocks into this block size.

A block's body (``engine/kv/block_copy.py``) is, layer by layer, K then V, each ``block_size``
token rows of ``num_kv_heads * head_dim`` values: ``2 * num_layers`` segments of rows (MLA: the
latent records, one segment per layer; ``pages/layout.pools_per_layer``). A token's
row is the same bytes whatever the block size, so re-paging B_src -> B_dst is concatenating each
segment's rows over consecutive source blocks and cutting them every B_dst rows. The block
hashes differ (a block's hash chains over its own tokens), so the importer computes both
chains for the prompt, reads the source blocks under the prefill side's namespace, verifies
them, and writes the re-paged blocks under this instance's namespace and hashes; the engine's
store tier then finds them like any other store block. Pure Python (bytes), no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kvcache.hashing import HashExtraKeys, hash_blocks, root_hash
from pagedkv.kvstore.codec import Rejected, decode_payload, encode_payload, store_key
from pagedkv.pages.layout import pools_per_layer


def repage(
    bodies: Sequence[bytes | memoryview],
    src_block_size: int,
    dst_block_size: int,
    num_segments: int,
    row_bytes: int,
) -> list[bytes]:
    """Bodies of the full ``dst_block_size`` blocks that consecutive source ``bodies`` (blocks
    0.. of one sequence) cover, in order; tokens past the last full destination block are
    dropped."""
    num_tokens = len(bodies) * src_block_size
    num_dst = num_tokens // dst_block_size
    src_seg = src_block_size * row_bytes
    segments = [
        b"".join(bytes(b[s * src_seg : (s + 1) * src_seg]) for b in bodies)
        for s in range(num_segments)
    ]
    dst_seg = dst_block_size * row_bytes
    return [
        b"".join(seg[j * dst_seg : (j + 1) * dst_seg] for seg in segments) for j in range(num_dst)
    ]


class RelayoutImporter:
    """Writes this instance's blocks for a prompt from the prefill side's blocks in the store.
    ``client`` is a ``kvstore.client.StoreClient`` (its failures are misses, never raised).
    Counters: ``num_blocks_written``, ``num_source_misses``, ``num_rejected``."""

    def __init__(
        self,
        client,
        src_namespace: bytes,
        dst_namespace: bytes,
        src_block_size: int,
        dst_block_size: int,
        num_layers: int,
        record_bytes: int,
        pools_per_layer: int = 2,
    ) -> None:
        self._client = client
        self._src_ns, self._dst_ns = src_namespace, dst_namespace
        self.src_block_size, self.dst_block_size = src_block_size, dst_block_size
        self._num_segments = pools_per_layer * num_layers
        self._row_bytes = record_bytes // self._num_segments
        self.num_blocks_written = 0
        self.num_source_misses = 0
        self.num_rejected = 0

    @classmethod
    def for_engine(cls, engine, peer, url: str, model_id: str) -> RelayoutImporter:
        from pagedkv.kvcache.hashing import DEFAULT_HASH_ALGORITHM
        from pagedkv.kvstore.address import parse_store_url
        from pagedkv.kvstore.client import StoreClient
        from pagedkv.kvstore.counters import StoreCounters
        from pagedkv.kvstore.namespace import store_namespace

        # The store keeps whole blocks (every KV head) whatever either side's tensor-parallel size.
        ours, theirs = engine.parts.page_format.whole(), peer.page_format.whole()
        return cls(
            StoreClient(parse_store_url(url), StoreCounters()),
            store_namespace(theirs, peer.model, DEFAULT_HASH_ALGORITHM),
            store_namespace(ours, model_id, DEFAULT_HASH_ALGORITHM),
            peer.page_format.block_size,
            ours.block_size,
            ours.num_layers,
            ours.record_bytes,
            pools_per_layer(ours.attention),
        )

    def import_prompts(self, prompts: Sequence[Sequence[int]], cache_salt: str | None) -> int:
        """Re-page every prompt's blocks that the prefill side stored; returns blocks written."""
        return sum(self.import_prompt(p, cache_salt) for p in prompts)

    def import_prompt(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        extra = HashExtraKeys(cache_salt=cache_salt)
        root = root_hash(extra)
        dst_hashes = hash_blocks(token_ids, self.dst_block_size, root, extra=extra)
        if not dst_hashes:
            return 0
        need_tokens = len(dst_hashes) * self.dst_block_size
        src_hashes = hash_blocks(token_ids, self.src_block_size, root, extra=extra)
        src_hashes = src_hashes[: -(-need_tokens // self.src_block_size)]
        payloads = self._client.get_run([store_key(self._src_ns, h) for h in src_hashes])
        body_bytes = self.src_block_size * self._num_segments * self._row_bytes
        bodies = []
        for h, payload in zip(src_hashes, payloads, strict=False):  # a run may stop early
            body = decode_payload(payload, self._src_ns, h, body_bytes)
            if isinstance(body, Rejected):
                self.num_rejected += 1
                break
            bodies.append(body)
        self.num_source_misses += len(src_hashes) - len(bodies)
        dst_bodies = repage(
            bodies, self.src_block_size, self.dst_block_size, self._num_segments, self._row_bytes
        )[: len(dst_hashes)]
        items = [
            (store_key(self._dst_ns, h), encode_payload(self._dst_ns, h, body))
            for h, body in zip(dst_hashes, dst_bodies, strict=False)
        ]
        written = self._client.put_many(items) if items else 0
        self.num_blocks_written += written
        return written
