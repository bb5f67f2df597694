"""The KV write: each new token's K and V rows go to their slot of the paged pool.

Grid: one program per (token, KV head); a program moves one ``head_dim`` row of K and one of V.
The slot (``block * block_size + offset``) is split into block and offset in the kernel, in
int64, so the pool's strides are honoured and a large pool does not overflow int32. A slot of
-1 marks a padding token (e.g. the tail of a CUDA-graph batch): its program stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_tiles import pool_strides
from pagedkv.pages.triton_rules import KV_WRITE

RULE = KV_WRITE  # any block size; head dim a power of two <= 256 (one tl.arange row)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_vcn,
    stride_vcb,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to write
        return
    dims = tl.arange(0, HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims)
    k_dst = k_cache_ptr + block * stride_kcn + offset * stride_kcb + head * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcn + offset * stride_vcb + head * stride_vch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty))


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hkv, D] into k_cache / v_cache [N, B, Hkv, D] at ``slot_mapping`` int64
    [T] (slot = block * B + offset); a slot of -1 is padding and is skipped. Mutates the
    caches, casting to their dtype. Raises UsageError for a head dim ``KV_WRITE`` refuses. Reads
    only shapes on the host: usable inside CUDA-graph capture."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    RULE.check(block_size, head_dim)
    num_tokens = k.shape[0]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the pool")
    if v_cache.shape != k_cache.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError("v_cache or slot_mapping does not match k_cache / k")
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("the head dim of k, v and the caches must be contiguous")
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *pool_strides(k_cache, v_cache),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
