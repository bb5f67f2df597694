"""Paged attention in plain torch: write new K/V by slot, read each sequence's context by its
block table, attend with ``scaled_dot_product_attention``.

KV storage (one pair per layer, allocated by the engine, see ``allocate_kv_caches``)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset      # token i of a sequence: block_table[i // B], i % B

A step's batch is the concatenation of every scheduled sequence's *new* tokens: a prefill chunk
(possibly on top of a cached prefix) or one decode token. ``AttentionMetadata`` describes it.
Any ``block_size >= 1`` works, including one block of ``max_model_len`` slots per sequence (the
reserved, contiguous baseline), because the reads only ever compute slots.

Decode sequences (one new token) attend together, their contexts gathered and padded to the
longest. Each prefill sequence attends on its own: padding twenty prompts to the longest one
made a 2,048-token mixed step 3-6x slower than the same prompts one by one (the padded
queries times the padded keys; docs/latency.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.native import MAX_ROWS as native_max_rows


@dataclass(frozen=True)
class _DecodeGroup:
    """The sequences with one new token, padded to ``[S, max_ctx]`` keys."""

    token_index: torch.Tensor | None  # int64 [S]: their rows in the batch; None: every row
    # What to gather, one of the two: whole blocks (int64 [S * blocks], the first
    # ceil(max_ctx / B) of each table: ~2x faster than slot by slot) or, when a block is much
    # longer than the contexts (a reserved region), slots (int64 [S * max_ctx]).
    gather_blocks: torch.Tensor | None
    gather_slots: torch.Tensor | None
    # float [S, 1, 1, max_ctx], 0 = may attend, -inf = padding; built once per step (a bool
    # mask is converted by every layer's call). None: every context has the same length.
    mask: torch.Tensor | None
    num_seqs: int
    max_ctx: int
    # First slot when the group is one sequence whose context sits in consecutive slots (its
    # blocks are consecutive ids, or it is one reserved region): K/V are read as a view,
    # without the gather. None otherwise.
    contiguous_from: int | None


@dataclass(frozen=True)
class _PrefillSeq:
    """One sequence with several new tokens (rows ``start:stop`` of the batch)."""

    start: int
    stop: int
    # Its context's slots, None when the whole context is new (a prompt without cached
    # prefix): it then attends its own new K/V with the causal kernel, nothing gathered.
    gather_slots: torch.Tensor | None
    mask: torch.Tensor | None  # float [1, 1, new, ctx]: bottom-right causal over the context
    contiguous_from: int | None  # as in ``_DecodeGroup``


@dataclass(frozen=True)
class _NativeDecode:
    """The sequences with one new token, for ``native.pk_decode_attention``: it reads their
    keys and values through their block tables, nothing gathered or padded."""

    token_index: torch.Tensor | None  # as in ``_DecodeGroup``
    tables: torch.Tensor  # int64 [S, blocks], contiguous
    ctx_lens: torch.Tensor  # int64 [S]


class AttentionPlan:
    """Everything the layers need that depends only on the metadata, built once per forward,
    and the scratch buffers its layers reuse one after another (``scratch``)."""

    def __init__(
        self,
        meta: AttentionMetadata,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        kernels=None,
    ) -> None:
        """``dtype``: the queries' (masks are built in it: attention takes no other).
        ``kernels``: ``native.kernels()`` when queries and caches are fp32 and the head size a
        multiple of 8 (the caller checks): decode attention then runs on the paged kernel."""
        self.kernels = kernels
        self.block_size = block_size
        self.slot_mapping = meta.slot_mapping.to(torch.int64).contiguous()
        starts = meta.query_start_loc.to(torch.int64)
        q_lens = starts[1:] - starts[:-1]
        ctx_lens = meta.context_lens.to(torch.int64)
        _validate(meta, q_lens, ctx_lens, block_size)
        tables = meta.block_tables.to(torch.int64)
        decode_ids = (q_lens == 1).nonzero().flatten()
        self.decode: _DecodeGroup | _NativeDecode | None = None
        if decode_ids.numel():
            whole = decode_ids.numel() == meta.num_seqs  # then row i is sequence i
            rows = None if whole else starts[decode_ids]
            ctx, table = ctx_lens[decode_ids], tables[decode_ids]
            if kernels is not None:
                self.decode = _NativeDecode(rows, table.contiguous(), ctx.contiguous())
            else:
                self.decode = _plan_decode(rows, ctx, table, block_size, dtype)
        self.prefills = [
            _plan_prefill(
                int(starts[i]), int(q_lens[i]), int(ctx_lens[i]), tables[i], block_size, dtype
            )
            for i in (q_lens > 1).nonzero().flatten().tolist()
        ]
        self._scratch: dict[str, torch.Tensor] = {}
        # Every row a decode token read by the paged kernel: a layer may run as one native call.
        self.native_decode_only = (
            isinstance(self.decode, _NativeDecode)
            and self.decode.token_index is None
            and not self.prefills
            and meta.num_tokens <= native_max_rows
        )

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer kept for this forward: every layer gathers into the same
        memory (a fresh 40 MB gather per layer cost 4x the copy itself, in page faults)."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._scratch[name] = torch.empty(shape, dtype=dtype)
        return buf


def _validate(
    meta: AttentionMetadata, q_lens: torch.Tensor, ctx_lens: torch.Tensor, block_size: int
) -> None:
    num_seqs = meta.num_seqs
    if num_seqs < 1:
        raise ValueError("a step needs at least one sequence")
    if meta.query_start_loc.shape != (num_seqs + 1,) or meta.block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc must be [num_seqs + 1] and block_tables [num_seqs, *]")
    if int(meta.query_start_loc[0]) != 0 or int(meta.query_start_loc[-1]) != meta.num_tokens:
        raise ValueError("query_start_loc must run from 0 to num_tokens")
    if bool((q_lens < 1).any()) or bool((ctx_lens < q_lens).any()):
        raise ValueError("every sequence needs 1 <= new tokens <= context_lens")
    if int(ctx_lens.max()) > meta.block_tables.shape[1] * block_size:
        raise ValueError("block_tables do not cover context_lens")


def _context_slots(tables: torch.Tensor, num_cols: int, block_size: int) -> torch.Tensor:
    """Slots of context positions ``0..num_cols-1`` of each row of ``tables`` ``[S, blocks]``."""
    cols = torch.arange(num_cols)
    return tables[:, cols // block_size] * block_size + cols % block_size


def _consecutive_from(slots: torch.Tensor) -> int | None:
    return int(slots[0]) if bool((slots.diff() == 1).all()) else None


def _plan_decode(
    rows: torch.Tensor | None,
    ctx: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
) -> _DecodeGroup:
    num_seqs, max_ctx = int(ctx.numel()), int(ctx.max())
    num_blocks = -(-max_ctx // block_size)
    gather_blocks = gather_slots = contiguous_from = None
    # Slots are needed to find a lone sequence's view, or to gather when blocks would copy
    # more than twice the context; computed at most once.
    by_blocks = num_blocks * block_size <= 2 * max_ctx
    if num_seqs == 1 or not by_blocks:
        gather_slots = _context_slots(tables, max_ctx, block_size).flatten()
    if num_seqs == 1:
        contiguous_from = _consecutive_from(gather_slots)
    if contiguous_from is None and by_blocks:
        gather_blocks, gather_slots = tables[:, :num_blocks].flatten(), None
    mask = None
    if bool((ctx != max_ctx).any()):
        padding = torch.arange(max_ctx)[None, :] >= ctx[:, None]
        mask = torch.zeros(num_seqs, 1, 1, max_ctx, dtype=dtype)
        mask.masked_fill_(padding[:, None, None], -torch.inf)
    return _DecodeGroup(rows, gather_blocks, gather_slots, mask, num_seqs, max_ctx, contiguous_from)


def _plan_prefill(
    start: int, new: int, ctx: int, table: torch.Tensor, block_size: int, dtype: torch.dtype
) -> _PrefillSeq:
    if new == ctx:
        return _PrefillSeq(start, start + new, None, None, None)
    gather_slots = _context_slots(table[None], ctx, block_size).flatten()
    # New token i sits at position ctx - new + i and sees keys 0..that position.
    hidden_keys = torch.arange(ctx)[None, :] > (ctx - new + torch.arange(new))[:, None]
    mask = torch.zeros(1, 1, new, ctx, dtype=dtype).masked_fill_(
        hidden_keys[None, None], -torch.inf
    )
    return _PrefillSeq(start, start + new, gather_slots, mask, _consecutive_from(gather_slots))


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
    num_tokens, num_heads, _ = q.shape
    lone = plan.decode is None and len(plan.prefills) == 1  # the batch is one prefill: TTFT
    out = None if lone else q.new_empty(num_tokens, num_heads * head_dim)
    if isinstance(g := plan.decode, _NativeDecode):
        attn = _native_decode(q, kv_cache, g, plan, scale)
        if g.token_index is None:
            out = attn
        else:
            out[g.token_index] = attn
    elif g is not None:
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
            _heads_first(q[p.start : p.stop], q.dtype, q.dtype), keys, values,
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True,
        )  # fmt: skip
        attn = attn[0].transpose(0, 1).reshape(p.stop - p.start, num_heads * head_dim)
        if lone:
            return attn
        out[p.start : p.stop] = attn
    return out


def _native_decode(
    q: torch.Tensor, kv_cache: KVCache, g: _NativeDecode, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """``[S, Hq * D]`` from the paged kernel (fp32 queries and caches, checked by the caller)."""
    k_cache, v_cache = kv_cache
    queries = q if g.token_index is None else q.index_select(0, g.token_index)
    if queries.stride(2) != 1 or queries.stride(1) != queries.shape[2]:
        queries = queries.contiguous()
    seqs, num_heads, head_dim = queries.shape
    out = torch.empty(seqs, num_heads * head_dim, dtype=torch.float32)
    plan.kernels.pk_decode_attention(
        queries.data_ptr(), queries.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        g.tables.data_ptr(), g.tables.stride(0), g.ctx_lens.data_ptr(), out.data_ptr(),
        seqs, num_heads, k_cache.shape[2], head_dim, plan.block_size, scale,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _read_decode(
    cache: torch.Tensor, g: _DecodeGroup, plan: AttentionPlan, name: str
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
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: _DecodeGroup, scale: float
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
