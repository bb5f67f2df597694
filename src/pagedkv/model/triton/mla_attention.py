"""An MLA layer's attention on the Triton backend (``TritonPlan.mla_attend``):

1. ``write_latents``: the step's latent records into their slots (slot -1: a padded row);
2. the decode rows, absorbed: ``absorb_queries`` (one batched product per head), the MLA
   decode kernel over the paged latents (``mla_decode.py``; the step's split count), then
   ``expand_output``: no host read, so a CUDA graph replays a decode step;
3. the prefill chunks (a mixed or prefill step): ``mla/paged.py``'s torch ops on the device,
   decompressed or absorbed by ``MLADims.decompress_prefill``, over a plan made once per step
   from the host metadata (its decode rows left to the kernel).
"""

from __future__ import annotations

import torch

from pagedkv.model.attention_plan import AttentionPlan
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.mla.latent import LatentWeights, absorb_queries, expand_output
from pagedkv.model.mla.paged import mla_paged_attention


def triton_mla_attend(
    plan,
    q: torch.Tensor,
    records: torch.Tensor,
    kv_cache: KVCache,
    latent: LatentWeights,
    scale: float,
) -> torch.Tensor:
    """``[T, H * Dv]`` for ``plan`` (a ``TritonPlan``); stores ``records`` into ``kv_cache``."""
    (pool,) = kv_cache
    kernels = plan.kernels
    kernels.write_latents(records, pool, plan.slot_mapping)
    out = None
    if plan.host_meta is not None:  # prefill chunks: torch ops (decode rows below)
        chunks = prefill_plan(plan, q.dtype)
        out = mla_paged_attention(q, records, kv_cache, chunks, latent, scale, written=True)
    if plan.num_decode:
        rows = plan.decode_rows
        queries = q if rows is None else q.index_select(0, rows)
        lat_q = absorb_queries(queries, latent).to(pool.dtype)
        lat_out = kernels.mla_decode(
            lat_q,
            pool,
            plan.decode_tables,
            plan.decode_lens,
            scale,
            latent.dims.kv_lora_rank,
            num_splits=plan.num_splits,
        )
        decoded = expand_output(lat_out.to(q.dtype), latent)
        if rows is None:
            return decoded
        assert out is not None  # a mixed step has prefill rows
        out.index_copy_(0, rows.to(torch.int64), decoded)
    assert out is not None  # a step has at least one row
    return out


def prefill_plan(plan, dtype: torch.dtype) -> AttentionPlan:
    """The torch plan of ``plan``'s prefill chunks (masks in ``dtype``), made once per step
    (the first MLA layer's call) from its host metadata; its decode group dropped (the
    kernel's)."""
    if plan.mla_prefill is None:
        device = plan.slot_mapping.device
        plan.mla_prefill = AttentionPlan(plan.host_meta, plan.block_size, dtype, None, device)
        plan.mla_prefill.decode = None  # the kernel reads the decode rows
    return plan.mla_prefill
