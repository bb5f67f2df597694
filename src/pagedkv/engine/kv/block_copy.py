"""Block-row copies: the one module that moves KV blocks, between pools or to bytes.

Every pool pagedkv keeps (the device pool, the host swap pool, the host tier) is, per layer, a
K and a V tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` (MLA: one tensor
of latent records, ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``), so a block
is one row of each tensor and moving blocks is moving rows. Swap (device <-> host swap pool), the host
tier (device <-> host tier), copy-on-write (device -> device) and the store (device <-> bytes)
all call this module, and each call moves a whole step's blocks of one kind together:

* ``copy_rows``: as a few slice copies per layer and tensor when the blocks form long runs of
  consecutive ids on both sides (a prompt's blocks are usually evicted and taken in order), else
  as one gather (``index_select`` into a buffer allocated once per call) and one scatter
  (``index_copy_``) per layer and tensor; never a Python loop per block. Pools may live on
  different devices (a GPU pool and a host pool): the rows cross once per tensor.
* ``copy_slot_prefixes``: the first ``n`` slots of a block into another of the same pool (a
  partial prefix hit, ``kvcache/partial.py``), as one gather and one scatter of the slots per
  layer and tensor.
* ``read_blocks`` / ``write_blocks``: a block's *body* in the page layout, layer by layer (K
  then V, each ``[block_size, num_kv_heads, head_dim]``; MLA: the latents
  ``[block_size, 1, R + Dr]``; C order, native little-endian): the page format's
  ``record_bytes * block_size`` bytes (``block_body_bytes``), what the store keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kvcache.tiers.contract import PrefixCopy
from pagedkv.model.kv_pool import KVCache

# Slice copies pay off when the average run is at least this long (fewer, bigger memcpys and no
# temporary); shorter runs go through one gather/scatter per tensor.
_MIN_MEAN_RUN = 4


def copy_rows(
    dst: list[KVCache], dst_rows: Sequence[int], src: list[KVCache], src_rows: Sequence[int]
) -> None:
    """``dst[l][t][dst_rows[i]] = src[l][t][src_rows[i]]`` for every layer ``l``, tensor ``t``
    (K, V) and ``i``. Destination rows must be distinct; a source row may repeat; no row may be
    both a source and a destination of one call (``dst`` and ``src`` may be the same pool, as
    for copy-on-write). Mutates ``dst`` only."""
    if not dst_rows:
        return
    runs: list[list[int]] = []  # [dst start, src start, length], by destination
    for d, s in sorted(zip(dst_rows, src_rows, strict=True)):
        last = runs[-1] if runs else None
        if last is not None and d == last[0] + last[2] and s == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([d, s, 1])
    if len(runs) * _MIN_MEAN_RUN <= len(dst_rows):
        for dst_pair, src_pair in zip(dst, src, strict=True):
            for to, frm in zip(dst_pair, src_pair, strict=True):
                for d, s, n in runs:
                    to[d : d + n].copy_(frm[s : s + n])
        return
    src0, dst0 = src[0][0], dst[0][0]
    s_idx = torch.tensor(src_rows, dtype=torch.int64, device=src0.device)
    d_idx = torch.tensor(dst_rows, dtype=torch.int64, device=dst0.device)
    # One gather buffer for every layer and tensor of the call (fresh memory costs page faults).
    rows = torch.empty((len(src_rows), *src0.shape[1:]), dtype=src0.dtype, device=src0.device)
    for dst_pair, src_pair in zip(dst, src, strict=True):
        for to, frm in zip(dst_pair, src_pair, strict=True):
            torch.index_select(frm, 0, s_idx, out=rows)
            to.index_copy_(0, d_idx, rows.to(to.device))


def copy_slot_prefixes(kv_caches: list[KVCache], copies: Sequence[PrefixCopy]) -> None:
    """For each ``(src, dst, n)`` of ``copies``: slots ``[0, n)`` of block ``src`` into block
    ``dst`` of the same pool, for every layer's K and V; the other slots of ``dst`` are kept.
    No destination slot may be a source slot of the call. Mutates the pool."""
    if not copies:
        return
    k0 = kv_caches[0][0]
    bs = k0.shape[1]
    src_slots = [src * bs + i for src, _, n in copies for i in range(n)]
    dst_slots = [dst * bs + i for _, dst, n in copies for i in range(n)]
    s_idx = torch.tensor(src_slots, dtype=torch.int64, device=k0.device)
    d_idx = torch.tensor(dst_slots, dtype=torch.int64, device=k0.device)
    for pair in kv_caches:
        for pool in pair:
            slots = pool.view(-1, *pool.shape[2:])  # [N * B, Hkv, D]: a slot is a row
            slots.index_copy_(0, d_idx, slots.index_select(0, s_idx))


def block_body_bytes(kv_caches: list[KVCache]) -> int:
    """Bytes of one block's body: a block row of every layer's tensors (K and V, or the
    latents), as the pools were allocated from the page format (``kv_pool._pool_shape``
    checks them against its record bytes)."""
    return sum(pool[0].numel() * pool.element_size() for pair in kv_caches for pool in pair)


def read_blocks(kv_caches: list[KVCache], block_ids: Sequence[int]) -> list[memoryview]:
    """The bodies of ``block_ids`` (copies: the blocks may be overwritten afterwards)."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches[0][0].device)
    # [N, L, pools, B, H, D]: one gather per layer and pool, then one contiguous copy.
    stacked = torch.stack(
        [torch.stack([pool[ids] for pool in pair], dim=1) for pair in kv_caches], dim=1
    )
    raw = memoryview(stacked.contiguous().cpu().view(torch.uint8).numpy()).cast("B")
    n = raw.nbytes // len(block_ids)
    return [raw[i * n : (i + 1) * n] for i in range(len(block_ids))]


def write_blocks(
    kv_caches: list[KVCache], block_ids: Sequence[int], bodies: Sequence[bytes | memoryview]
) -> None:
    """Scatter ``bodies`` (each ``block_body_bytes``) into ``block_ids``. Mutates the pools."""
    if not block_ids:
        return
    n = block_body_bytes(kv_caches)
    buf = bytearray(n * len(bodies))  # writable: torch.frombuffer shares it without a warning
    for i, body in enumerate(bodies):
        buf[i * n : (i + 1) * n] = body
    k0 = kv_caches[0][0]
    flat = torch.frombuffer(buf, dtype=torch.uint8).view(k0.dtype)
    pools = len(kv_caches[0])
    blocks = flat.view(len(block_ids), len(kv_caches), pools, *k0.shape[1:]).to(k0.device)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    for layer, pair in enumerate(kv_caches):
        for index, pool in enumerate(pair):
            pool[ids] = blocks[:, layer, index]
