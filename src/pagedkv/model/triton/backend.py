"""``TritonBackend``: the attention backend on pagedkv's Triton kernels (the GPU's default;
under Triton's interpreter on the CPU, for tests). A step's plan is ``TritonPlan``
(``attention.py``); copy-on-write runs on the block-copy kernel."""

from __future__ import annotations

import torch

from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.triton.attention import TritonPlan
from pagedkv.model.triton.kernels import TritonKernels, load_kernels, num_sms
from pagedkv.pages.backends import TRITON, BackendRule
from pagedkv.pages.triton_rules import mla_programs


class TritonBackend:
    """``AttentionBackend`` on ``kernels`` (loaded for ``device``)."""

    def __init__(self, model, device: torch.device, kernels: TritonKernels | None = None) -> None:
        """For ``model`` (its KV heads) on ``device``; ``kernels``: loaded here unless given."""
        self.kernels = load_kernels(device) if kernels is None else kernels
        self.device, self.num_kv_heads = device, model.config.num_kv_heads
        if model.config.mla is not None:  # decode programs per sequence: blocks of heads
            self.num_kv_heads = mla_programs(model.config.mla.num_heads)

    @property
    def rule(self) -> BackendRule:
        return TRITON

    def plan(
        self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int
    ) -> TritonPlan:
        return TritonPlan(meta, block_size, self.num_kv_heads, self.device, self.kernels)

    def graph_plan(
        self, meta: AttentionMetadata, block_size: int, max_context_len: int
    ) -> TritonPlan:
        """A decode plan over ``meta``'s static device buffers, its split count fixed by the rule
        at ``max_context_len``: what a CUDA graph records and replays."""
        num_seqs, num_kv_heads = meta.num_seqs, self.num_kv_heads
        splits = self.kernels.decode_splits(
            num_seqs, num_kv_heads, max_context_len, num_sms(self.device)
        )
        return TritonPlan.for_graph(meta, block_size, self.kernels, splits)

    def copy_blocks(
        self,
        pool: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        self.kernels.copy_blocks(pool, src, dst, num_tokens)
