"""``TritonPlan``: one step's attention on pagedkv's Triton kernels, the GPU backend.

Built once per forward from the step's ``AttentionMetadata`` (host tensors, as the runner
makes them; moved to the device here, once, not per layer), then ``rope_attend`` per layer:

1. ``rope_write_kv``: RoPE, and the new tokens' K/V into their slots (slot -1: a padded row,
   skipped);
2. the decode rows (one new token each): ``paged_decode``, one program per (sequence, KV
   head[, split]), the split count fixed for the step by ``decode_splits`` (or by the CUDA graph
   it runs in); in a mixed step they are found by their rows, among the prefill chunks;
3. the prefill chunks: ``paged_prefill``, varlen, causal against each one's cached prefix and
   itself, read through the block table (a prefix hit or a chunk gathers nothing).

So a mixed step runs each kind of row on its own kernel: its decode rows no longer cost a
16-row prefill tile each (the H200 measured a mixed step's ~80-100 decode rows ~80 ms dearer
than a prefill-only step of the same size, where their K/V read in ~4 ms).

Unlike ``AttentionPlan`` nothing here reads a device tensor back to the host, so a decode plan
over static buffers is what a CUDA graph captures (``graphs.py``). Importing this module does
not import triton (the kernels are loaded by ``kernels.load_kernels``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedkv.model.layers import RMSNorm, SwiGLU
    from pagedkv.model.mla.latent import LatentWeights
    from pagedkv.model.projection import ProjectionBase

from pagedkv.model.attention_backend import HeadShape, LayerOps
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.attention_plan import AttentionPlan
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.triton.kernels import TritonKernels, num_sms
from pagedkv.model.triton.mla_attention import triton_mla_attend

PREFILL_BLOCK_M = 16  # query rows per prefill program: tl.dot's smallest tile


class TritonPlan(LayerOps):
    """The step's ops on the Triton kernels (``attention_backend.StepOps``) and what every
    layer's attention reads, on the device. ``num_splits`` (decode only):
    None = ``decode_splits``'s rule for this step."""

    def __init__(
        self,
        meta: AttentionMetadata,
        block_size: int,
        num_kv_heads: int,
        device: torch.device,
        kernels: TritonKernels,
        num_splits: int | None = None,
    ) -> None:
        self.kernels = kernels
        self.block_size = block_size
        self.num_tokens = meta.num_tokens
        self.decode_only = meta.num_tokens == meta.num_seqs  # every sequence one new token
        # MLA's prefill chunks run on torch ops over a plan made from the host metadata.
        self.host_meta = None if self.decode_only else meta
        self.mla_prefill: AttentionPlan | None = None  # made from it by the first MLA layer
        self.slot_mapping = _on(meta.slot_mapping, device, torch.int64)
        self.block_tables = _on(meta.block_tables, device, torch.int32)
        self.context_lens = _on(meta.context_lens, device, torch.int32)
        self.query_start_loc = _on(meta.query_start_loc, device, torch.int32)
        self.tiles: torch.Tensor | None = None
        # A mixed step's decode rows: their sequences' tables and lengths, and their rows.
        self.decode_tables, self.decode_lens = self.block_tables, self.context_lens
        self.decode_rows: torch.Tensor | None = None
        starts = meta.query_start_loc.tolist()  # host: the runner's metadata, no sync
        single = [s for s in range(meta.num_seqs) if starts[s + 1] - starts[s] == 1]
        if not self.decode_only:
            tiles = kernels.prefill_tiles(starts, PREFILL_BLOCK_M, 2)
            self.tiles = _on(torch.tensor(tiles, dtype=torch.int32), device, torch.int32)
            if single:
                index = torch.tensor(single, dtype=torch.int64)
                self.decode_tables = _on(meta.block_tables[index], device, torch.int32)
                self.decode_lens = _on(meta.context_lens[index], device, torch.int32)
                rows = torch.tensor([starts[s] for s in single], dtype=torch.int32)
                self.decode_rows = _on(rows, device, torch.int32)
        self.num_decode = len(single)
        self.num_splits = 1
        if single:
            if num_splits is None:
                lens = meta.context_lens.tolist()  # host: as above
                longest = max(lens[s] for s in single)
                num_splits = kernels.decode_splits(
                    len(single), num_kv_heads, longest, num_sms(device)
                )
            self.num_splits = num_splits

    @classmethod
    def for_graph(
        cls,
        meta: AttentionMetadata,
        block_size: int,
        kernels: TritonKernels,
        num_splits: int,
    ) -> TritonPlan:
        """A decode plan over ``meta``'s own (static, device) tensors, with the split count
        fixed: a CUDA graph replays it with whatever those buffers hold then."""
        plan = cls.__new__(cls)
        plan.kernels, plan.block_size = kernels, block_size
        plan.num_tokens, plan.decode_only, plan.tiles = meta.num_tokens, True, None
        plan.slot_mapping, plan.block_tables = meta.slot_mapping, meta.block_tables
        plan.context_lens, plan.query_start_loc = meta.context_lens, meta.query_start_loc
        plan.decode_tables, plan.decode_lens = plan.block_tables, plan.context_lens
        plan.decode_rows, plan.host_meta, plan.mla_prefill = None, None, None
        plan.num_decode, plan.num_splits = meta.num_seqs, num_splits
        return plan

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        heads: HeadShape,
        scale: float,
    ) -> torch.Tensor:
        """RoPE on Q and K and the K/V store in one launch (``rope_kv_write.py``: bit-equal to
        the torch ops it replaces, Q rotated in ``qkv``), then ``attend_stored``."""
        k_cache, v_cache = kv_cache
        q, _, _ = self.kernels.rope_write_kv(
            qkv, cos, sin, k_cache, v_cache, self.slot_mapping, heads.num_heads, in_place=True
        )
        return self.attend_stored(q, kv_cache, scale)

    def attend_stored(self, q: torch.Tensor, kv_cache: KVCache, scale: float) -> torch.Tensor:
        """``[T, Hq * D]`` of ``q`` ``[T, Hq, D]`` once the step's K/V are in ``kv_cache``:
        the prefill chunks' tiles, then the decode rows."""
        k_cache, v_cache = kv_cache
        kernels = self.kernels
        out = None
        if self.tiles is not None:
            out = kernels.paged_prefill(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.context_lens,
                self.query_start_loc,
                self.tiles,
                scale,
                block_m=PREFILL_BLOCK_M,
            )
        if self.num_decode:
            out = kernels.paged_decode(
                q,
                k_cache,
                v_cache,
                self.decode_tables,
                self.decode_lens,
                scale,
                num_splits=self.num_splits,
                out=out,
                rows=self.decode_rows,
            )
        assert out is not None  # a step has at least one row
        return out.view(self.num_tokens, -1)

    def mla_attend(
        self,
        q: torch.Tensor,
        records: torch.Tensor,
        kv_cache: KVCache,
        latent: LatentWeights,
        scale: float,
    ) -> torch.Tensor:
        """MLA: the records stored, decode rows on the MLA kernel (``mla_attention.py``)."""
        return triton_mla_attend(self, q, records, kv_cache, latent, scale)

    # In bf16 each RMSNorm is one launch, the second with the residual add before it
    # (``rms_norm.py``), and SiLU * up is one (``silu_mul.py``). fp32 keeps the modules' own
    # ops: a Triton sum of squares or ``exp`` differs from torch's by ulps, and fp32 is the path
    # greedy tokens are checked on against the CPU; in bf16 those ulps vanish in the rounding.

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return norm(x)
        return self.kernels.rms_norm(x, norm.weight, norm.eps)

    def add_norm(
        self, norm: RMSNorm, residual: torch.Tensor, proj: ProjectionBase, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual.dtype != torch.bfloat16:
            return super().add_norm(norm, residual, proj, x)
        return self.kernels.rms_norm(proj(x), norm.weight, norm.eps, residual)

    def silu_mul(self, mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return mlp.gated(x)
        return self.kernels.silu_mul(mlp.gate_up(x))


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor on ``device``. A host tensor crosses from pinned
    memory (the runner's are pinned already; one made here is pinned first), so the copy does
    not wait: the kernels run after it on the same stream."""
    t = t.to(dtype=dtype).contiguous()
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
