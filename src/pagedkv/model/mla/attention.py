"""``MLAAttention``: the attention part of an MLA decoder layer (DeepSeek-V2/V3), up to the
output projection, which the layer owns (``decoder_layer.py``). Its order::

    q, kv = q_kv_a_proj(x)                  the hidden state's two products in one matmul:
                                            queries (or their low rank) and the KV compression
    q = q_b_proj(q_a_norm(q))               with q_lora_rank only
    latent, k_pe = kv_a_norm(kv[:R]), kv[R:]
    q_pe, k_pe = rope(q_pe), rope(k_pe)     the rotary dims only (YaRN: ``rope.py``)
    a = mla_attend(q, [latent, k_pe])       the backend's op: the record stored, attention over
                                            the paged latents (``paged.py``, Triton's kernel)

The norms' epsilon is DeepSeek's fixed 1e-6 (its reference code and transformers build both
latent norms without the config's ``rms_norm_eps``). The softmax scale is ``qk_head_dim^-0.5``
times YaRN's mscale squared.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.attention_backend import StepOps
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, apply_rotary
from pagedkv.model.mla.latent import LatentWeights
from pagedkv.model.projection import Projection

LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """The latent attention's projections and norms; ``kv_b`` is ``kv_b_proj``'s weight per
    head ``[H, Dn + Dv, R]``, which the attention uses as a tensor (absorbed into the queries
    and the output, or decompressing the latents), never as a projection of the hidden state."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dims = config.mla
        assert dims is not None  # the family's attention is "mla" (ModelConfig checks)
        self.dims = dims
        heads, hidden = dims.num_heads, config.hidden_size
        q_width = dims.q_lora_rank or heads * dims.qk_head_dim
        self.q_kv_a_proj = Projection(hidden, q_width + dims.record_width)
        self.q_a_norm: RMSNorm | None = None
        self.q_b_proj: Projection | None = None
        if dims.q_lora_rank is not None:
            self.q_a_norm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Projection(dims.q_lora_rank, heads * dims.qk_head_dim)
        self.kv_a_norm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b = nn.Parameter(
            torch.empty(heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank),
            requires_grad=False,
        )
        mscale = config.yarn.softmax_mscale() if config.yarn is not None else 1.0
        self.scale = dims.qk_head_dim**-0.5 * mscale

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        ops: StepOps,
    ) -> torch.Tensor:
        """``[T, H * Dv]`` of the normed hidden state ``x`` ``[T, hidden]``; this step's latent
        records written into ``kv_cache`` (the backend's op)."""
        dims = self.dims
        num_tokens = x.shape[0]
        fused = self.q_kv_a_proj(x)
        q_width = fused.shape[1] - dims.record_width
        q = fused[:, :q_width]
        if self.q_b_proj is not None and self.q_a_norm is not None:
            q = self.q_b_proj(self.q_a_norm(q.contiguous()))
        q = q.reshape(num_tokens, dims.num_heads, dims.qk_head_dim)
        rope = slice(dims.qk_nope_head_dim, None)
        q[:, :, rope] = apply_rotary(q[:, :, rope], cos, sin)
        kv = fused[:, q_width:]
        records = torch.empty_like(kv)
        records[:, : dims.kv_lora_rank] = self.kv_a_norm(kv[:, : dims.kv_lora_rank].contiguous())
        k_pe = kv[:, None, dims.kv_lora_rank :]
        records[:, dims.kv_lora_rank :] = apply_rotary(k_pe, cos, sin)[:, 0]
        return ops.mla_attend(q, records, kv_cache, self.latent_weights(), self.scale)

    def load_kv_b(self, kv_b: torch.Tensor) -> None:
        """Take ``kv_b_proj``'s weight ``[H * (Dn + Dv), R]`` (shape checked by the loader),
        kept per head."""
        dims = self.dims
        per_head = dims.qk_nope_head_dim + dims.v_head_dim
        kv_b = kv_b.reshape(dims.num_heads, per_head, dims.kv_lora_rank).contiguous()
        self.kv_b = nn.Parameter(kv_b, requires_grad=False)

    def latent_weights(self) -> LatentWeights:
        """What the backends' attention reads of this layer's weights."""
        return LatentWeights(self.kv_b, self.dims)
