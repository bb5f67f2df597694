"""The block copy: copy-on-write forks duplicate whole KV blocks inside one layer's pool.

Grid: one program per (pair, chunk of ``CHUNK`` elements of a block). A block of the contiguous
pool [N, B, Hkv, D] is one flat run of ``B * Hkv * D`` elements, so a program copies a masked
flat chunk of it and no tile has to match the block's shape: any block size and head dim work.
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
    stride_block,  # elements between two blocks
    block_numel,  # B * Hkv * D
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    # int64: block id times the block stride overflows int32 on a large pool.
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inside = offs < block_numel
    values = tl.load(cache_ptr + src * stride_block + offs, mask=inside)
    tl.store(cache_ptr + dst * stride_block + offs, values, mask=inside)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache [N, B, Hkv, D] (one layer's K or V pool): block dst[i] becomes a copy of block
    src[i] (int64 [n] each, on the cache's device). The caller guarantees no dst is also a src
    in the same call (programs run in no order). Mutates cache. Reads only shapes on the host:
    usable inside CUDA-graph capture."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    RULE.check(block_size, head_dim)
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} are not two [n]")
    num_pairs = src.shape[0]
    block_numel = block_size * num_kv_heads * head_dim
    if num_pairs == 0 or block_numel == 0:
        return
    # A block must be one flat run for the chunked copy (the pool is allocated contiguous).
    if not cache[0].is_contiguous():
        raise ValueError("each block of the cache must be contiguous")
    grid = (num_pairs, triton.cdiv(block_numel, CHUNK))
    _block_copy_kernel[grid](cache, src, dst, cache.stride(0), block_numel, CHUNK=CHUNK)
