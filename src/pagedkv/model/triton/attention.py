"""``TritonPlan``: one step's attention on pagedkv's Triton kernels, the GPU backend.

Built once per forward from the step's ``AttentionMetadata`` (host tensors, as the runner
makes them; moved to the device here, once, not per layer), then ``attend`` per layer:

1. ``write_kv``: the new tokens' K/V into their slots (slot -1: a padded row, skipped);
2. a step of decode rows only: ``paged_decode``, one program per (sequence, KV head[, split]),
   the split count fixed for the step by ``decode_splits`` (or by the CUDA graph it runs in);
3. any other step: ``paged_prefill`` over every sequence, varlen, causal against its cached
   prefix and itself, read through the block table (a prefix hit or a chunk gathers nothing);
   the decode rows of a mixed step are tiles of one query row there.

Unlike ``AttentionPlan`` nothing here reads a device tensor back to the host, so a decode plan
over static buffers is what a CUDA graph captures (``graphs.py``). Importing this module does
not import triton (the kernels are loaded by ``kernels.load_kernels``).
"""

from __future__ import annotations

import torch

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.triton.kernels import TritonKernels, num_sms

PREFILL_BLOCK_M = 16  # query rows per prefill program: tl.dot's smallest tile


class TritonPlan:
    """What every layer's Triton attention reads, on the device. ``num_splits`` (decode only):
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
        self.slot_mapping = _on(meta.slot_mapping, device, torch.int64)
        self.block_tables = _on(meta.block_tables, device, torch.int32)
        self.context_lens = _on(meta.context_lens, device, torch.int32)
        self.query_start_loc = _on(meta.query_start_loc, device, torch.int32)
        self.tiles: torch.Tensor | None = None
        self.num_splits = 1
        if self.decode_only:
            if num_splits is None:
                max_context_len = int(meta.context_lens.max()) if meta.num_seqs else 0
                num_splits = kernels.decode_splits(
                    meta.num_seqs, num_kv_heads, max_context_len, block_size, num_sms(device)
                )
            self.num_splits = num_splits
        else:
            starts = meta.query_start_loc.tolist()  # host: the runner's metadata, no sync
            tiles = kernels.prefill_tiles(starts, PREFILL_BLOCK_M)
            self.tiles = _on(torch.tensor(tiles, dtype=torch.int32), device, torch.int32)

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
        plan.num_splits = num_splits
        return plan

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        scale: float,
    ) -> torch.Tensor:
        """One layer: ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (RoPE applied) ->
        ``[T, Hq * D]``. Writes the new K/V into ``kv_cache`` first (a prefill reads itself)."""
        k_cache, v_cache = kv_cache
        kernels = self.kernels
        kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.decode_only:
            out = kernels.paged_decode(
                q, k_cache, v_cache, self.block_tables, self.context_lens, scale,
                num_splits=self.num_splits,
            )  # fmt: skip
        else:
            out = kernels.paged_prefill(
                q, k_cache, v_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.tiles, scale, block_m=PREFILL_BLOCK_M,
            )  # fmt: skip
        return out.view(self.num_tokens, -1)


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor on ``device`` (host memory crosses without
    waiting: the kernels run after the copy on the same stream)."""
    return t.to(dtype=dtype).contiguous().to(device, non_blocking=True)
