"""The ``torch-sdpa`` backend: torch ops on any device (K/V gathered by slot, then
``scaled_dot_product_attention``; ``attention.py``, and ``mla/paged.py`` over latent pages): the
reference path every other backend is held to. ``TorchStep`` is its step's ops, and the base of the native backend's."""

from __future__ import annotations

import torch

from pagedkv.model.attention import paged_attention
from pagedkv.model.attention_backend import HeadShape, LayerOps
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.attention_plan import AttentionPlan
from pagedkv.model.kv_pool import KVCache, copy_pool_rows
from pagedkv.model.layers import rotated_qkv
from pagedkv.model.mla.latent import LatentWeights
from pagedkv.model.mla.paged import mla_paged_attention
from pagedkv.pages.backends import TORCH_SDPA, BackendRule


class TorchStep(LayerOps):
    """``StepOps`` over an ``AttentionPlan``: RoPE by torch ops, then ``paged_attention``
    (which writes the new K/V first); every other op the modules' own."""

    def __init__(self, plan: AttentionPlan) -> None:
        self.plan = plan

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        heads: HeadShape,
        scale: float,
    ) -> torch.Tensor:
        q, k, v = rotated_qkv(qkv, cos, sin, heads)
        return paged_attention(q, k, v, kv_cache, self.plan, scale)

    def mla_attend(
        self,
        q: torch.Tensor,
        records: torch.Tensor,
        kv_cache: KVCache,
        latent: LatentWeights,
        scale: float,
    ) -> torch.Tensor:
        return mla_paged_attention(q, records, kv_cache, self.plan, latent, scale)


class TorchBackend:
    """``AttentionBackend`` on torch ops: queries in the model's dtype on ``device``."""

    def __init__(self, model, device: torch.device) -> None:
        self.device, self.dtype = device, model.dtype

    @property
    def rule(self) -> BackendRule:
        return TORCH_SDPA

    def plan(self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int) -> TorchStep:
        return TorchStep(AttentionPlan(meta, block_size, self.dtype, None, self.device))

    def graph_plan(self, meta: AttentionMetadata, block_size: int, max_context_len: int) -> None:
        return None  # its plan reads the metadata on the host: no graph can replay it

    def copy_blocks(
        self,
        pool: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        copy_pool_rows(pool, src, dst, num_tokens)
