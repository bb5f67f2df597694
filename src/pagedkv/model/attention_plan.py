"""``AttentionPlan``: what every layer's attention needs from a step's metadata, computed once
per forward: which rows decode and which prefill, what each reads of the paged cache (whole
blocks, slots, a view of consecutive slots, or the block tables themselves for the native
kernel), the padding and causal masks, and scratch buffers the layers reuse."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.native import MAX_ROWS as native_max_rows


@dataclass(frozen=True)
class DecodeGroup:
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
class PrefillSeq:
    """One sequence with several new tokens (rows ``start:stop`` of the batch)."""

    start: int
    stop: int
    # Its context's slots, None when the whole context is new (a prompt without cached
    # prefix): it then attends its own new K/V with the causal kernel, nothing gathered.
    gather_slots: torch.Tensor | None
    mask: torch.Tensor | None  # float [1, 1, new, ctx]: bottom-right causal over the context
    contiguous_from: int | None  # as in ``DecodeGroup``


@dataclass(frozen=True)
class NativeAttention:
    """Every sequence of the step, for ``native.pk_paged_attention``: it reads their keys and
    values through their block tables, decode tokens and prefill chunks in one call, nothing
    gathered or padded."""

    tables: torch.Tensor  # int64 [S, blocks], contiguous
    ctx_lens: torch.Tensor  # int64 [S]
    q_starts: torch.Tensor  # int64 [S]: each sequence's first row in the batch
    q_lens: torch.Tensor  # int64 [S]: its new tokens
    decode_only: bool  # every sequence one new token: row s is sequence s


class AttentionPlan:
    """Everything the layers need that depends only on the metadata, built once per forward,
    and the scratch buffers its layers reuse one after another (``scratch``)."""

    def __init__(
        self,
        meta: AttentionMetadata,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        kernels=None,
        device: torch.device | None = None,
    ) -> None:
        """``dtype``: the queries' (masks are built in it: attention takes no other).
        ``kernels``: ``native.kernels()`` when queries and caches are both fp32 or both bf16 and
        the head size a multiple of 8 (the caller checks): every sequence's attention then runs
        in one call of the paged kernel (``native``), and ``decode``/``prefills`` stay empty.
        ``device``: where the caches are (a GPU: the plan is made on the host, then moved;
        this is the reference path there, ``model/triton/`` the fast one)."""
        self.device = torch.device("cpu") if device is None else device
        if meta.slot_mapping.device.type != "cpu":  # the plan reads it on the host
            meta = AttentionMetadata(*(t.cpu() for t in _fields(meta)))
        self.kernels = kernels
        self.block_size = block_size
        self.slot_mapping = meta.slot_mapping.to(torch.int64).contiguous()
        starts = meta.query_start_loc.to(torch.int64)
        q_lens = starts[1:] - starts[:-1]
        ctx_lens = meta.context_lens.to(torch.int64)
        _validate(meta, q_lens, ctx_lens, block_size)
        tables = meta.block_tables.to(torch.int64)
        self.native: NativeAttention | None = None
        self.decode: DecodeGroup | None = None
        self.prefills: list[PrefillSeq] = []
        if kernels is not None:
            self.native = NativeAttention(
                tables.contiguous(),
                ctx_lens.contiguous(),
                starts[:-1].contiguous(),
                q_lens.contiguous(),
                bool((q_lens == 1).all()),
            )
        else:
            self.decode, self.prefills = _plan_torch(
                starts, q_lens, ctx_lens, tables, block_size, dtype
            )
        if self.device.type != "cpu":
            self.slot_mapping = self.slot_mapping.to(self.device)
            self.decode = _moved(self.decode, self.device)
            self.prefills = [_moved(p, self.device) for p in self.prefills]
        self._scratch: dict[str, torch.Tensor] = {}
        # Every row a decode token read by the paged kernel: a layer may run as one native call.
        self.native_decode_only = (
            self.native is not None
            and self.native.decode_only
            and meta.num_tokens <= native_max_rows
        )

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer kept for this forward: every layer gathers into the same
        memory (a fresh 40 MB gather per layer cost 4x the copy itself, in page faults)."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._scratch[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf


def _moved(group, device: torch.device):
    """``group`` (a frozen plan record, or None) with its tensors on ``device``."""
    if group is None:
        return None
    moved = {
        f.name: getattr(group, f.name).to(device)
        for f in fields(group)
        if isinstance(getattr(group, f.name), torch.Tensor)
    }
    return replace(group, **moved)


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
) -> DecodeGroup:
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
    return DecodeGroup(rows, gather_blocks, gather_slots, mask, num_seqs, max_ctx, contiguous_from)


def _plan_prefill(
    start: int, new: int, ctx: int, table: torch.Tensor, block_size: int, dtype: torch.dtype
) -> PrefillSeq:
    if new == ctx:
        return PrefillSeq(start, start + new, None, None, None)
    gather_slots = _context_slots(table[None], ctx, block_size).flatten()
    # New token i sits at position ctx - new + i and sees keys 0..that position.
    hidden_keys = torch.arange(ctx)[None, :] > (ctx - new + torch.arange(new))[:, None]
    mask = torch.zeros(1, 1, new, ctx, dtype=dtype).masked_fill_(
        hidden_keys[None, None], -torch.inf
    )
    return PrefillSeq(start, start + new, gather_slots, mask, _consecutive_from(gather_slots))


def _fields(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    return meta.slot_mapping, meta.block_tables, meta.context_lens, meta.query_start_loc


def _plan_torch(
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[DecodeGroup | None, list[PrefillSeq]]:
    """The torch path's plan (host tensors): the decode rows as one group, each prefill chunk
    on its own."""
    decode = None
    if (decode_ids := (q_lens == 1).nonzero().flatten()).numel():
        whole = decode_ids.numel() == ctx_lens.numel()  # then row i is sequence i
        rows = None if whole else starts[decode_ids]
        decode = _plan_decode(rows, ctx_lens[decode_ids], tables[decode_ids], block_size, dtype)
    prefill_ids = (q_lens > 1).nonzero().flatten().tolist()  # host: made from meta on the host
    prefills = [
        _plan_prefill(
            int(starts[i]), int(q_lens[i]), int(ctx_lens[i]), tables[i], block_size, dtype
        )
        for i in prefill_ids
    ]
    return decode, prefills
