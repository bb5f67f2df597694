"""``mla_paged_attention``: MLA over the paged latent pool in torch ops (the torch-sdpa backend's
``mla_attend``, the native backend's on the CPU, and the Triton backend's prefill chunks).

The pool of one layer is ``(latents,)``: ``[num_blocks, block_size, 1, R + Dr]``, one latent
record per slot (``kv_pool.allocate_kv_caches``). A step writes its new records first (a
prefill reads itself), then reads each sequence's context through the ``AttentionPlan``
(``attention_plan.py``, the same plan the MHA path reads: whole blocks, slots or a view):

- the decode rows together, absorbed (``latent.absorb_queries``, then MQA of every head over
  the gathered records, as two batched products and an fp32 softmax: keys the whole record,
  values its first R values, padding masked, then ``expand_output``);
- each prefill chunk on its own, decompressed or absorbed by ``MLADims.decompress_prefill``
  (the fewer multiply-adds), causal from the bottom right over its cached prefix and itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The MHA path's readers of a plan's gathers: one copy of "read a context through the plan".
from pagedkv.model.attention import _as, _read, _read_decode
from pagedkv.model.attention_plan import AttentionPlan, PrefillSeq
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.mla.latent import LatentWeights, absorb_queries, decompress, expand_output


def mla_paged_attention(
    q: torch.Tensor,
    records: torch.Tensor,
    kv_cache: KVCache,
    plan: AttentionPlan,
    latent: LatentWeights,
    scale: float,
    written: bool = False,
) -> torch.Tensor:
    """Attention of one MLA layer: ``q`` ``[T, H, Dn + Dr]`` (rope part rotated), ``records``
    ``[T, R + Dr]`` this step's latent records (k_pe rotated). Mutates ``kv_cache``: the records
    land in their slots first (``written``: the caller stored them). Returns ``[T, H * Dv]``,
    a new tensor (what ``o_proj`` reads)."""
    (pool,) = kv_cache
    flat = pool.view(-1, pool.shape[-1])
    if not written:
        flat.index_copy_(0, plan.slot_mapping, _as(records, pool.dtype))
    dims = latent.dims
    out = q.new_empty(q.shape[0], q.shape[1] * dims.v_head_dim)
    if (g := plan.decode) is not None:
        queries = q if g.token_index is None else q.index_select(0, g.token_index)
        context = _as(_read_decode(pool, g, plan, "latent"), q.dtype)  # [S, L, 1, R + Dr]
        attn = _absorbed_decode(queries, context[:, :, 0], g.mask, latent, scale)
        if g.token_index is None:  # every row decodes: the result is the output
            out = attn
        else:
            out[g.token_index] = attn
    for p in plan.prefills:
        out[p.start : p.stop] = _prefill(q, records, flat, p, latent, scale)
    return out


def _prefill(
    q: torch.Tensor,
    records: torch.Tensor,
    flat: torch.Tensor,
    p: PrefillSeq,
    latent: LatentWeights,
    scale: float,
) -> torch.Tensor:
    """``[n, H * Dv]`` of one prefill chunk of ``n`` new tokens over its context."""
    queries, context = q[p.start : p.stop], chunk_context(q, records, flat, p)
    if not latent.dims.decompress_prefill(queries.shape[0], context.shape[0]):
        return _absorbed_prefill(queries, context, p.mask, latent, scale)
    return attend_decompressed(queries, context, p.mask, latent, scale)


def chunk_context(
    q: torch.Tensor, records: torch.Tensor, flat: torch.Tensor, p: PrefillSeq
) -> torch.Tensor:
    """The records ``[L, R + Dr]`` a prefill chunk attends (its cached prefix and itself), in
    the queries' dtype; the step's records already stored into ``flat`` (the pool's rows)."""
    if p.gather_slots is None:  # the whole context is new: its records, as if read back
        return _as(_as(records[p.start : p.stop], flat.dtype), q.dtype)
    return _as(_read(flat, p.gather_slots, p.contiguous_from), q.dtype)


def attend_decompressed(
    queries: torch.Tensor,
    context: torch.Tensor,
    mask: torch.Tensor | None,
    latent: LatentWeights,
    scale: float,
) -> torch.Tensor:
    """``[n, H * Dv]``: ``n`` queries ``[n, H, Dn + Dr]`` over the per-head K and V of the
    records ``context`` (``mask`` ``[1, 1, n, L]`` additive; None: causal, n == L)."""
    keys, values = decompress(context, latent)
    # Values padded to the keys' width: SDPA's fused CPU kernel wants one head width (with
    # 192 / 128 it fell back to a path 4x slower); the padding's outputs are dropped.
    width = keys.shape[-1]
    padded = F.pad(values, (0, width - values.shape[-1])) if values.shape[-1] < width else values
    attn = F.scaled_dot_product_attention(
        queries.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        padded.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return attn[0, :, :, : values.shape[-1]].transpose(0, 1).reshape(queries.shape[0], -1)


def _absorbed_decode(
    queries: torch.Tensor,
    context: torch.Tensor,
    mask: torch.Tensor | None,
    latent: LatentWeights,
    scale: float,
) -> torch.Tensor:
    """``[S, H * Dv]``: each sequence's one token, its ``H`` latent queries against its
    records ``context`` ``[S, L, R + Dr]`` (``mask`` ``[S, 1, 1, L]`` additive, None: equal
    lengths)."""
    lat_q = absorb_queries(queries, latent)  # [S, H, R + Dr]
    scores = torch.bmm(lat_q, context.transpose(1, 2))  # [S, H, L]: one read of the records
    return expand_output(_softmax_values(scores, mask, context, latent, scale), latent)


def _absorbed_prefill(
    queries: torch.Tensor,
    context: torch.Tensor,
    mask: torch.Tensor | None,
    latent: LatentWeights,
    scale: float,
) -> torch.Tensor:
    """``[n, H * Dv]``: one chunk's ``n`` tokens over its records ``context`` ``[L, R + Dr]``
    (``mask`` ``[1, 1, n, L]`` additive; None: causal, n == L)."""
    lat_q = absorb_queries(queries, latent).transpose(0, 1)  # [H, n, R + Dr]
    scores = torch.matmul(lat_q, context.t())  # [H, n, L]
    if mask is None:
        mask = torch.full(scores.shape[1:], -torch.inf, device=scores.device).triu(1)
    out = _softmax_values(scores, mask, context, latent, scale)  # [H, n, R]
    return expand_output(out.transpose(0, 1), latent)


def _softmax_values(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    context: torch.Tensor,
    latent: LatentWeights,
    scale: float,
) -> torch.Tensor:
    """``softmax(scores * scale + mask) @ C``: the weighted sum of the records' compressed
    part, softmax in fp32. Explicit products, not SDPA: on the CPU its kernel takes neither a
    576-wide head nor values narrower than keys at speed (measured 5-8x slower)."""
    scores = scores.float().mul_(scale)
    if mask is not None:
        scores += mask.reshape(mask.shape[0], *mask.shape[2:]) if mask.dim() == 4 else mask
    probs = scores.softmax(-1).to(context.dtype)
    return torch.matmul(probs, context[..., : latent.dims.kv_lora_rank])
