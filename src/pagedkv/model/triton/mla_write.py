"""The latent record write: each new token's record (the normalised compressed KV, then the
rotated k_pe) goes to its slot of an MLA layer's pool ``[N, B, 1, R + Dr]``.

Grid: one program per token, a record row each (padded to a power of two, masked: any width).
A slot of -1 marks a padding token (the tail of a CUDA-graph batch): nothing is stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_write_kernel(
    records_ptr,
    pool_ptr,
    slot_mapping_ptr,
    stride_rt,
    stride_pb,
    stride_pt,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    dims = tl.arange(0, WIDTH_PAD)
    ok = dims < WIDTH
    record = tl.load(records_ptr + token * stride_rt + dims, mask=ok)
    dst = pool_ptr + (slot // BLOCK_SIZE) * stride_pb + (slot % BLOCK_SIZE) * stride_pt + dims
    tl.store(dst, record.to(pool_ptr.dtype.element_ty), mask=ok)


def write_latents(records: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``records`` ``[T, R + Dr]`` into ``pool`` ``[N, B, 1, R + Dr]`` at ``slot_mapping``
    (int64 ``[T]``, -1: skipped), cast to the pool's dtype. Mutates the pool; reads only shapes
    on the host (CUDA-graph capture may record it)."""
    num_tokens, width = records.shape
    if pool.shape[2:] != (1, width) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"records {tuple(records.shape)} do not fit the pool {tuple(pool.shape)}")
    if records.stride(1) != 1 or pool.stride(3) != 1:
        raise ValueError("records and the pool must be contiguous in their last dim")
    if num_tokens == 0:
        return
    _mla_write_kernel[(num_tokens,)](
        records,
        pool,
        slot_mapping,
        records.stride(0),
        pool.stride(0),
        pool.stride(1),
        WIDTH=width,
        WIDTH_PAD=triton.next_power_of_2(width),
        BLOCK_SIZE=pool.shape[1],
    )
