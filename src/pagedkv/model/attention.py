"""Paged attention in plain torch: write new K/V by slot, read each sequence's context by its
block table, attend with ``scaled_dot_product_attention``.

KV storage (one pair per layer, allocated by the engine, see ``allocate_kv_caches``)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset      # token i of a sequence: block_table[i // B], i % B

A step's batch is the concatenation of every scheduled sequence's *new* tokens: a prefill chunk
(possibly on top of a cached prefix) or one decode token. ``AttentionMetadata`` describes it.
Any ``block_size >= 1`` works, including one block of ``max_model_len`` slots per sequence (the
reserved, contiguous baseline), because the reads only ever compute slots.

On the CPU with pagedkv's kernels every sequence attends in one call of
``native.pk_paged_attention``, straight from the block tables. The torch path (no kernels,
other dtypes, the GPU's reference): decode sequences (one new token) attend together, their
contexts gathered and padded to the longest; each prefill sequence attends on its own: padding
twenty prompts to the longest one made a 2,048-token mixed step 3-6x slower than the same
prompts one by one (the padded queries times the padded keys; docs/latency.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.model.attention_plan import AttentionPlan, DecodeGroup
from pagedkv.model.kv_pool import KVCache

__all__ = ["AttentionPlan", "paged_attention"]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    plan: AttentionPlan,
    scale: float,
    written: bool = False,
) -> torch.Tensor:
    """Attention of one layer. ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (RoPE applied).

    Mutates ``kv_cache``: the new K/V land in their slots *before* any sequence reads, so a
    prefill chunk sees itself (``written``: the caller has put them there already). Returns
    ``[T, Hq * D]``, a new tensor.
    """
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if not written:
        k_flat.index_copy_(0, plan.slot_mapping, _as(k, k_cache.dtype))
        v_flat.index_copy_(0, plan.slot_mapping, _as(v, v_cache.dtype))
    if plan.native is not None:
        return _native(q, kv_cache, plan, scale)
    num_tokens, num_heads, _ = q.shape
    lone = plan.decode is None and len(plan.prefills) == 1  # the batch is one prefill: TTFT
    out = None if lone else q.new_empty(num_tokens, num_heads * head_dim)
    if (g := plan.decode) is not None:
        keys = _read_decode(k_cache, g, plan, "k")
        values = _read_decode(v_cache, g, plan, "v")
        attn = _attend_decode(q, _as(keys, q.dtype), _as(values, q.dtype), g, scale)
        if g.token_index is None:  # every row decodes: the result is the output
            out = attn
        else:
            out[g.token_index] = attn
    for p in plan.prefills:
        if p.gather_slots is None:
            # Its K/V are exactly this step's, rounded through the cache dtype as if read.
            keys = _heads_first(k[p.start : p.stop], k_cache.dtype, q.dtype)
            values = _heads_first(v[p.start : p.stop], v_cache.dtype, q.dtype)
        else:
            keys = _heads_first(_read(k_flat, p.gather_slots, p.contiguous_from), q.dtype, q.dtype)
            values = _heads_first(
                _read(v_flat, p.gather_slots, p.contiguous_from), q.dtype, q.dtype
            )
        attn = F.scaled_dot_product_attention(
            _heads_first(q[p.start : p.stop], q.dtype, q.dtype),
            keys,
            values,
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        attn = attn[0].transpose(0, 1).reshape(p.stop - p.start, num_heads * head_dim)
        if lone:
            return attn
        out[p.start : p.stop] = attn
    return out


def _native(q: torch.Tensor, kv_cache: KVCache, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """``[T, Hq * D]`` from the paged kernel (queries and caches both fp32 or both bf16,
    checked by the caller; the new K/V already in their slots)."""
    k_cache, v_cache = kv_cache
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
    n = plan.native
    kernel = plan.kernels.pk_paged_attention
    if q.dtype == torch.bfloat16:
        kernel = plan.kernels.pk_paged_attention_bf16
    kernel(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        n.tables.data_ptr(),
        n.tables.stride(0),
        n.ctx_lens.data_ptr(),
        n.q_starts.data_ptr(),
        n.q_lens.data_ptr(),
        out.data_ptr(),
        n.ctx_lens.numel(),
        num_heads,
        k_cache.shape[2],
        head_dim,
        plan.block_size,
        scale,
        torch.get_num_threads(),
    )
    return out


def _read_decode(
    cache: torch.Tensor, g: DecodeGroup, plan: AttentionPlan, name: str
) -> torch.Tensor:
    """The decode group's contexts ``[S, max_ctx, Hkv, D]`` from one layer's cache (a view of
    it or of the plan's scratch buffer: valid until the next layer reads)."""
    block_size, kv_shape = cache.shape[1], cache.shape[2:]
    if g.gather_blocks is None:
        flat = cache.view(-1, *kv_shape)
        if g.contiguous_from is not None:
            return flat[g.contiguous_from : g.contiguous_from + g.max_ctx][None]
        out = plan.scratch(name, (g.gather_slots.numel(), *kv_shape), cache.dtype)
        return torch.index_select(flat, 0, g.gather_slots, out=out).view(g.num_seqs, -1, *kv_shape)
    out = plan.scratch(name, (g.gather_blocks.numel(), block_size, *kv_shape), cache.dtype)
    torch.index_select(cache, 0, g.gather_blocks, out=out)
    return out.view(g.num_seqs, -1, *kv_shape)[:, : g.max_ctx]


def _attend_decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: DecodeGroup, scale: float
) -> torch.Tensor:
    """``[S, Hq * D]``: each decode sequence's one query over its context (keys and values
    ``[S, max_ctx, Hkv, D]``, padding masked)."""
    s, num_kv_heads, head_dim = g.num_seqs, keys.shape[2], keys.shape[3]
    queries = q if g.token_index is None else q.index_select(0, g.token_index)
    # Query head h uses KV head h // group: [S, Hq, D] is [S, Hkv, group, D], no K/V repeat.
    queries = queries.view(s, num_kv_heads, -1, head_dim)
    attn = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=g.mask, scale=scale
    )
    return attn.reshape(s, -1)


def _read(flat: torch.Tensor, slots: torch.Tensor, contiguous_from: int | None) -> torch.Tensor:
    """Rows ``slots`` of a flat cache ``[slots, Hkv, D]``: a view when they are consecutive."""
    if contiguous_from is not None:
        return flat[contiguous_from : contiguous_from + slots.numel()]
    return flat.index_select(0, slots)  # ~2x faster than advanced indexing on this CPU


def _heads_first(x: torch.Tensor, via: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[T, H, D]`` as ``[1, H, T, D]`` in ``dtype``, rounded through ``via``."""
    return _as(_as(x, via), dtype).transpose(0, 1).unsqueeze(0)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the call when it is one already (a decode step makes ~200 of
    them; each dispatch costs a few microseconds between the matmuls)."""
    return x if x.dtype == dtype else x.to(dtype)
