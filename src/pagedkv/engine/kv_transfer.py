"""Device KV blocks <-> bytes, for the shared store tier (``kvstore/``).

A block's body is its KV in the page layout, layer by layer: for each layer, K then V, each
``[block_size, num_kv_heads, head_dim]`` in the pool's dtype (C order, native little-endian),
so a body is the page format's ``record_bytes * block_size`` bytes (``pool_layout`` asks
``pages/layout.py``). Each direction moves a whole step's blocks in one
gather (save) or one scatter (load) per layer and pool, never one copy per block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pagedkv.model.kv_pool import KVCache, pool_layout

_SAMPLE_ELEMENTS = 4096  # elements of each weight tensor that go into the model identity


def block_body_bytes(kv_caches: list[KVCache]) -> int:
    """Bytes of one block's body (every layer's K and V)."""
    return pool_layout(kv_caches).block_bytes(kv_caches[0][0].shape[1])


def read_blocks(kv_caches: list[KVCache], block_ids: Sequence[int]) -> list[memoryview]:
    """The bodies of ``block_ids`` (copies: the blocks may be overwritten afterwards)."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.int64)
    # [N, L, 2, B, H, D]: one gather per layer and pool, then one contiguous copy.
    stacked = torch.stack([torch.stack((k[ids], v[ids]), dim=1) for k, v in kv_caches], dim=1)
    raw = memoryview(stacked.contiguous().view(torch.uint8).numpy()).cast("B")
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
    blocks = flat.view(len(block_ids), len(kv_caches), 2, *k0.shape[1:])
    ids = torch.tensor(block_ids, dtype=torch.int64)
    for layer, (k, v) in enumerate(kv_caches):
        k[ids] = blocks[:, layer, 0]
        v[ids] = blocks[:, layer, 1]


def model_identity(model: torch.nn.Module) -> str:
    """A digest of the model's weights (names, shapes, dtypes and a strided sample of each
    tensor): two engines share stored KV only when they compute the same KV, and two models of
    one shape (or one model quantized two ways) must not. Reads ~4K elements per tensor."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE_ELEMENTS)].contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
