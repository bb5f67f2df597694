"""The two attention backends on ``AttentionPlan`` (``attention_plan.py``): ``torch-sdpa``, torch
ops on any device (K/V gathered by slot, then ``scaled_dot_product_attention``: the reference
path), and ``native``, pagedkv's C kernels on the CPU (every sequence in one paged call, read
through the block tables; whole decode layers in one call), with torch ops for what they cannot
take (a dtype or head size outside theirs)."""

from __future__ import annotations

import torch

from pagedkv.model import native
from pagedkv.model.attention import paged_attention
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.attention_plan import AttentionPlan
from pagedkv.model.kv_pool import KVCache, copy_pool_rows
from pagedkv.model.native.layer import run_native_layer
from pagedkv.pages.attention_rules import NATIVE, TORCH_SDPA, BackendRule


class PlannedStep:
    """``StepAttention`` over an ``AttentionPlan``: ``paged_attention`` for a layer, and the
    native kernels' fused layer (``native/layer.py``) where the plan has them."""

    def __init__(self, plan: AttentionPlan) -> None:
        self.plan = plan

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, scale: float
    ) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, self.plan, scale)

    def run_layer(self, layer, hidden, cos, sin, kv_cache: KVCache) -> torch.Tensor | None:
        if self.plan.kernels is None:
            return None
        return run_native_layer(self.plan, layer, hidden, cos, sin, kv_cache)


class TorchBackend:
    """``AttentionBackend`` on torch ops: queries in ``dtype`` on ``device``."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    @property
    def rule(self) -> BackendRule:
        return TORCH_SDPA

    def plan(
        self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int
    ) -> PlannedStep:
        return PlannedStep(AttentionPlan(meta, block_size, self.dtype, None, self.device))

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


class NativeBackend:
    """``AttentionBackend`` on pagedkv's C kernels (CPU), for ``model`` (a ``CausalLM`` whose
    load found them: ``model.attention_kernels``)."""

    def __init__(self, model) -> None:
        self.model = model

    @property
    def rule(self) -> BackendRule:
        return NATIVE

    def plan(
        self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int
    ) -> PlannedStep:
        kernels = usable_kernels(self.model, kv_caches)
        if kernels is not None:  # C reads and writes where the slots say: check them first
            check_slots(meta, kv_caches[0][0].shape[0], block_size)
        model = self.model
        return PlannedStep(AttentionPlan(meta, block_size, model.dtype, kernels, model.device))

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


def usable_kernels(model, kv_caches: list[KVCache]):
    """The native kernels where attention may use them: queries and caches both fp32 or both
    bf16, contiguous caches, a head size of a multiple of 8 and at most 256; else None."""
    kernels, dtype, head_dim = model.attention_kernels, model.dtype, model.config.head_dim
    if (
        kernels is None
        or dtype not in (torch.float32, torch.bfloat16)
        or kv_caches[0][0].dtype != dtype
        or not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
        or head_dim % 8
        or head_dim > native.MAX_HEAD_DIM
        or torch.compiler.is_compiling()
    ):
        return None
    return kernels


def check_slots(meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """ValueError unless every slot written and every block read lies in the pool (the torch
    path's index ops raise by themselves; the native kernels would touch other memory)."""
    slots, tables = meta.slot_mapping, meta.block_tables
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(f"slot_mapping outside the pool of {num_blocks * block_size} slots")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(f"block_tables name blocks outside the pool of {num_blocks}")
