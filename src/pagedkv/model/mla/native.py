"""MLA on pagedkv's C paged-attention kernel (the native backend's step for MLA models).

Absorbed, every head's latent query attends one shared 576-wide "head", the latent record,
whose values are the same rows: ``native.pk_paged_attention`` reads keys and values through
the block tables in place, so it takes the record pool as both and MQA's grouping (all query
heads on one KV head): each record is read once per sequence, nothing gathered, every decode
row and absorbed prefill chunk of the step in one call. The weighted sum covers the whole
record; its rope part is dropped before ``expand_output``. Prefill chunks that
``MLADims.decompress_prefill`` sends to the decompressed form run on torch ops (``paged.py``).
Where the kernel cannot take the step (no kernels, a dtype or record width outside its
contract) the step is ``TorchStep``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.model import native
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.attention_plan import AttentionPlan, PrefillSeq
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.mla.latent import LatentWeights, absorb_queries, expand_output
from pagedkv.model.mla.paged import attend_decompressed, chunk_context
from pagedkv.model.torch_backend import TorchStep


@dataclass(frozen=True)
class KernelRows:
    """The sequences the kernel attends (int64, contiguous) and the chunks it leaves."""

    tables: torch.Tensor  # [S', blocks]
    ctx_lens: torch.Tensor  # [S']
    q_starts: torch.Tensor  # [S']: each one's first row in the batch
    q_lens: torch.Tensor  # [S']
    decompressed: tuple[PrefillSeq, ...]  # the torch plan's chunks left to torch ops


class NativeLatentStep(TorchStep):
    """``StepOps`` of an MLA model on the native backend (``NativeBackend.plan``)."""

    def __init__(self, plan: AttentionPlan, meta: AttentionMetadata, kernels) -> None:
        super().__init__(plan)
        self.meta, self.kernels = meta, kernels
        self._rows: KernelRows | None = None  # made by the first layer (the rule needs dims)

    def mla_attend(
        self,
        q: torch.Tensor,
        records: torch.Tensor,
        kv_cache: KVCache,
        latent: LatentWeights,
        scale: float,
    ) -> torch.Tensor:
        (pool,) = kv_cache
        if not self._usable(q, pool):
            return super().mla_attend(q, records, kv_cache, latent, scale)
        flat = pool.view(-1, pool.shape[-1])
        flat.index_copy_(0, self.plan.slot_mapping, records.to(pool.dtype))
        rows = self._kernel_rows(latent)
        num_tokens, num_heads, _ = q.shape
        width, rank = pool.shape[-1], latent.dims.kv_lora_rank
        lat_q = absorb_queries(q, latent)  # [T, H, R + Dr], contiguous
        make = torch.zeros if rows.decompressed else torch.empty  # their rows: no NaN garbage
        lat_out = make(num_tokens, num_heads * width, dtype=q.dtype)
        kernel = self.kernels.pk_paged_attention
        if q.dtype == torch.bfloat16:
            kernel = self.kernels.pk_paged_attention_bf16
        kernel(
            lat_q.data_ptr(),
            lat_q.stride(0),
            pool.data_ptr(),  # keys: the whole record
            pool.data_ptr(),  # values: the same rows (their rope part dropped below)
            rows.tables.data_ptr(),
            rows.tables.stride(0),
            rows.ctx_lens.data_ptr(),
            rows.q_starts.data_ptr(),
            rows.q_lens.data_ptr(),
            lat_out.data_ptr(),
            rows.ctx_lens.numel(),
            num_heads,
            1,  # one KV "head": every query head reads the record
            width,
            self.plan.block_size,
            scale,
            torch.get_num_threads(),
        )
        out = expand_output(lat_out.view(num_tokens, num_heads, width)[:, :, :rank], latent)
        for p in rows.decompressed:
            queries, context = q[p.start : p.stop], chunk_context(q, records, flat, p)
            out[p.start : p.stop] = attend_decompressed(queries, context, p.mask, latent, scale)
        return out

    def _usable(self, q: torch.Tensor, pool: torch.Tensor) -> bool:
        """The kernel's contract: queries and pool both fp32 or both bf16, a contiguous pool,
        a record width of a multiple of 8 and at most ``native.MAX_HEAD_DIM``."""
        width = pool.shape[-1]
        return (
            self.kernels is not None
            and q.dtype == pool.dtype
            and q.dtype in (torch.float32, torch.bfloat16)
            and pool.is_contiguous()
            and width % 8 == 0
            and width <= native.MAX_HEAD_DIM
            and not torch.compiler.is_compiling()
        )

    def _kernel_rows(self, latent: LatentWeights) -> KernelRows:
        if self._rows is None:
            self._rows = kernel_rows(self.meta, self.plan, latent)
        return self._rows


def kernel_rows(meta: AttentionMetadata, plan: AttentionPlan, latent: LatentWeights) -> KernelRows:
    """Decode rows and the prefill chunks ``decompress_prefill`` runs absorbed go to the
    kernel; the others stay with the torch plan's chunks (host metadata: read here once)."""
    starts = meta.query_start_loc.to(torch.int64)
    q_lens, ctx_lens = starts[1:] - starts[:-1], meta.context_lens.to(torch.int64)
    decompressed = tuple(
        p
        for p in plan.prefills
        if latent.dims.decompress_prefill(p.stop - p.start, int(ctx_lens[_seq_of(starts, p)]))
    )
    keep = torch.ones(q_lens.numel(), dtype=torch.bool)
    for p in decompressed:
        keep[_seq_of(starts, p)] = False
    return KernelRows(
        meta.block_tables.to(torch.int64)[keep].contiguous(),
        ctx_lens[keep].contiguous(),
        starts[:-1][keep].contiguous(),
        q_lens[keep].contiguous(),
        decompressed,
    )


def _seq_of(starts: torch.Tensor, p: PrefillSeq) -> int:
    """The sequence whose rows begin at ``p.start``."""
    return int(torch.searchsorted(starts, p.start))
