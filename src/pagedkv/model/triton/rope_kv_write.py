"""Rotary embedding of Q and K and the KV write, in one launch.

The torch path of a layer (``DecoderLayer._rotated`` then ``kv_write.write_kv``) is three
elementwise ops over the ``[T, Hq + Hkv, D]`` view of the QKV product, a new Q/K tensor, then a
launch that copies K and V into their slots: here one program reads a token's Q, K and V heads
once, writes rotated Q and K to ``out`` and rotated K and V to the paged pool.

Grid: one program per (token, ``HEAD_BLOCK`` heads among the row's Hq + 2 Hkv heads, Q then K
then V). Each head row is loaded as its two halves: the rotation is half-split ("NeoX",
pairs (i, i + D/2)), the only one ``layers.apply_rotary`` applies (the GGUF loader un-permutes
llama.cpp's interleaved Q/K rows). A slot of -1 (padding) writes nothing to the pool; its Q/K
rows are still rotated into ``out``, as torch rotates them.

The arithmetic is ``apply_rotary``'s, bit for bit in fp32 and bf16: ``cos`` ``[cos, cos]`` and
``sin`` ``[-sin, sin]`` as ``RotaryEmbedding.cos_sin`` makes them (taken, not recomputed),
``x * cos`` rounded to the dtype, then ``torch.addcmul``'s ``+ roll(x) * sin`` as one fused
multiply-add (torch's CPU kernel is contracted to an FMA; in bf16 the product is exact in fp32
so an FMA and a multiply-add agree), rounded to the dtype. K/V are cast to the pool's dtype on
the way in, as ``write_kv`` casts them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.triton.decode_tiles import pool_strides
from pagedkv.pages.triton_rules import KV_WRITE

RULE = KV_WRITE  # any block size; head dim a power of two <= 256 (here also >= 2: two halves)
TILE_ELEMENTS = 4096  # a program's heads x head dim (32 heads of 128: 2 programs a Llama-3 token)


@triton.jit
def _rope_kv_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_out,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_vcn,
    stride_vcb,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # HEAD_DIM // 2: the rotation's pairs are (i, i + HALF)
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    dims = tl.arange(0, HALF)
    rotated = heads < NUM_HEADS + NUM_KV_HEADS  # Q and K heads; V heads follow them
    live = heads < NUM_HEADS + 2 * NUM_KV_HEADS
    row = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(row, mask=live[:, None], other=0.0)
    x2 = tl.load(row + HALF, mask=live[:, None], other=0.0)
    cos1 = tl.load(cos_ptr + token * stride_cos + dims).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + dims).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + token * stride_sin + dims).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + token * stride_sin + HALF + dims).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    a1 = (x1.to(tl.float32) * cos1).to(dtype).to(tl.float32)  # torch's ``x * cos``, rounded
    a2 = (x2.to(tl.float32) * cos2).to(dtype).to(tl.float32)
    r1 = tl.fma(x2.to(tl.float32), sin1, a1).to(dtype)  # torch.addcmul(x * cos, roll(x), sin)
    r2 = tl.fma(x1.to(tl.float32), sin2, a2).to(dtype)
    out = out_ptr + token * stride_out + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out, r1, mask=rotated[:, None])
    tl.store(out + HALF, r2, mask=rotated[:, None])

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding token, nothing goes to the pool
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        is_k = rotated & (heads >= NUM_HEADS)
        is_v = live & (heads >= NUM_HEADS + NUM_KV_HEADS)
        kv_head = tl.where(is_k, heads - NUM_HEADS, heads - NUM_HEADS - NUM_KV_HEADS)
        kv_head = tl.maximum(kv_head, 0).to(tl.int64)[:, None]  # Q rows: masked, kept in range
        k_dst = k_cache_ptr + block * stride_kcn + offset * stride_kcb + kv_head * stride_kch
        v_dst = v_cache_ptr + block * stride_vcn + offset * stride_vcb + kv_head * stride_vch
        k_dtype = k_cache_ptr.dtype.element_ty
        v_dtype = v_cache_ptr.dtype.element_ty
        tl.store(k_dst + dims[None, :], r1.to(k_dtype), mask=is_k[:, None])
        tl.store(k_dst + HALF + dims[None, :], r2.to(k_dtype), mask=is_k[:, None])
        tl.store(v_dst + dims[None, :], x1.to(v_dtype), mask=is_v[:, None])
        tl.store(v_dst + HALF + dims[None, :], x2.to(v_dtype), mask=is_v[:, None])


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    *,
    in_place: bool = False,
    head_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on the Q and K heads of ``qkv`` and the rotated K and V into the pool, one launch.

    ``qkv`` [T, (Hq + 2 Hkv) * D]: the QKV projection's output, Q heads then K then V (rows may
    be strided, columns contiguous), fp32 or bf16; ``cos`` / ``sin`` [T, 1, D] or [T, D] in
    ``qkv``'s dtype, as ``RotaryEmbedding.cos_sin`` returns them (``[cos, cos]``,
    ``[-sin, sin]``); ``k_cache`` / ``v_cache`` [N, B, Hkv, D] (any dtype: K/V are cast);
    ``slot_mapping`` [T] int64 or int32, slot = block * B + offset, -1 for padding.

    Returns ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``: q and k rotated, views of one new
    tensor ``[T, Hq + Hkv, D]`` (of ``qkv`` itself when ``in_place``: its Q/K columns are then
    overwritten), v a view of ``qkv``'s V columns. Mutates the pools' slots of
    ``slot_mapping`` (and ``qkv`` when ``in_place``), nothing else. ``head_block``: heads a
    program (a power of two; default ``TILE_ELEMENTS // D``, tests set it to split a token).
    Reads only shapes and strides on the host (no sync: usable inside CUDA-graph capture).
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _check(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    num_tokens = qkv.shape[0]
    rotated_width = (num_heads + num_kv_heads) * head_dim
    if in_place:
        out = qkv[:, :rotated_width]
    else:
        out = torch.empty(num_tokens, rotated_width, dtype=qkv.dtype, device=qkv.device)
    if num_tokens > 0:
        _launch(qkv, cos, sin, out, k_cache, v_cache, slot_mapping, num_heads, head_block)
    rotated = out.view(num_tokens, num_heads + num_kv_heads, head_dim)
    v = qkv[:, rotated_width:].view(num_tokens, num_kv_heads, head_dim)
    return rotated[:, :num_heads], rotated[:, num_heads:], v


def _check(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> None:
    """``rope_write_kv``'s argument checks (UsageError or ValueError), shapes only."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    RULE.check(block_size, head_dim)
    num_tokens = qkv.shape[0]
    total_heads = num_heads + 2 * num_kv_heads
    if head_dim < 2:
        raise ValueError("head dim 1 has no halves to rotate")
    if qkv.dim() != 2 or qkv.shape[1] != total_heads * head_dim or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv {tuple(qkv.shape)}: want [T, {total_heads * head_dim}] with contiguous columns"
        )
    if qkv.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"qkv is {qkv.dtype}: want float32 or bfloat16")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[0] != num_tokens or t.numel() != num_tokens * head_dim or t.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(t.shape)}: want [{num_tokens}, 1, {head_dim}]")
        if t.dtype != qkv.dtype:
            raise ValueError(f"{name} is {t.dtype}: want qkv's {qkv.dtype}")
    if v_cache.shape != k_cache.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError("v_cache or slot_mapping does not match k_cache / qkv")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head dim of the caches must be contiguous")


def _launch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    head_block: int | None,
) -> None:
    """The launch of ``rope_write_kv`` (its arguments checked)."""
    num_tokens, (_, block_size, num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape
    total_heads = num_heads + 2 * num_kv_heads
    if head_block is None:
        head_block = max(1, TILE_ELEMENTS // head_dim)
    head_block = min(head_block, triton.next_power_of_2(total_heads))
    if head_block & (head_block - 1):
        raise ValueError(f"head_block {head_block} is not a power of two")
    grid = (num_tokens, triton.cdiv(total_heads, head_block))
    _rope_kv_write_kernel[grid](
        qkv,
        cos,
        sin,
        out,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        *pool_strides(k_cache, v_cache),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_BLOCK=head_block,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
    )
