"""The block copy: copy-on-write forks duplicate whole KV blocks inside one layer's pool, and a
partial prefix hit copies the first ``n`` slots of a block (``kvcache/partial.py``).

Grid: one program per (pair, chunk of ``CHUNK`` elements of a block). A block of the contiguous
pool [N, B, Hkv, D] is one flat run of ``B * Hkv * D`` elements, so a program copies a masked
flat chunk of it and no tile has to match the block's shape: any block size and head dim work.
Its first ``n`` slots are the run's first ``n * Hkv * D`` elements: a per-pair slot count only
narrows the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.pages.triton_rules import BLOCK_COPY

RULE = BLOCK_COPY  # any block size, any head dim
CHUNK = 1024  # elements per program: a few KiB, enough to keep a load in flight per warp


@triton.jit
def _block_copy_kernel(
    cache_ptr,
    src_ptr,
    dst_ptr,
    count_ptr,  # slots to copy per pair (read only when HAS_COUNTS)
    stride_block,  # elements between two blocks
    block_numel,  # B * Hkv * D
    slot_numel,  # Hkv * D
    CHUNK: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    # int64: block id times the block stride overflows int32 on a large pool.
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inside = offs < block_numel
    if HAS_COUNTS:
        inside = inside & (offs < tl.load(count_ptr + pair).to(tl.int64) * slot_numel)
    values = tl.load(cache_ptr + src * stride_block + offs, mask=inside)
    tl.store(cache_ptr + dst * stride_block + offs, values, mask=inside)


def copy_blocks(
    cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_tokens: torch.Tensor | None = None,
) -> None:
    """cache [N, B, Hkv, D] (one layer's K or V pool): block dst[i] becomes a copy of block
    src[i] (int64 [n] each, on the cache's device); with ``num_tokens`` (int64 [n], same
    device) only its slots ``[0, num_tokens[i])``, the rest of dst[i] kept. The caller
    guarantees no dst is also a src in the same call (programs run in no order). Mutates
    cache. Reads only shapes on the host: usable inside CUDA-graph capture."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    RULE.check(block_size, head_dim)
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} are not two [n]")
    if num_tokens is not None and num_tokens.shape != src.shape:
        raise ValueError(f"num_tokens {tuple(num_tokens.shape)} is not one count per pair")
    num_pairs = src.shape[0]
    block_numel = block_size * num_kv_heads * head_dim
    if num_pairs == 0 or block_numel == 0:
        return
    # A block must be one flat run for the chunked copy (the pool is allocated contiguous).
    if not cache[0].is_contiguous():
        raise ValueError("each block of the cache must be contiguous")
    grid = (num_pairs, triton.cdiv(block_numel, CHUNK))
    counts = src if num_tokens is None else num_tokens  # any int64 [n]: unread without counts
    slot_numel = num_kv_heads * head_dim
    _block_copy_kernel[grid](
        cache,
        src,
        dst,
        counts,
        cache.stride(0),
        block_numel,
        slot_numel,
        CHUNK=CHUNK,
        HAS_COUNTS=num_tokens is not None,
    )
