"""The one decoder layer of every family pagedkv runs (Llama, Mistral, Qwen2, Qwen3), over the
paged KV cache. Its op order is written here and nowhere else::

    x = norm(h)                                  input RMSNorm
    qkv = qkv_proj(x)                            Q, K, V in one product (+ bias: Qwen2)
    q, k = q_norm(q), k_norm(k)                  per-head RMSNorm (Qwen3), before RoPE
    a = rope_attend(qkv)                         RoPE, this step's K/V stored, paged attention
    x, h = add_norm(h + o_proj(a))               residual add, post-attention RMSNorm
    h = h + down_proj(silu_mul(gate_up_proj(x)))  SwiGLU, the second residual add

A backend supplies the *ops* (``attention_backend.StepOps``: the norms, the attention with its
store, the add + norm, SiLU * up), fused where it has kernels; a family differs by a row of
``config.ARCHITECTURES`` (biases, q/k norms, the GGUF RoPE layout), never by code. One backend
may run a whole layer in one call (``layer_chain``: the native C decode chain, which is this
same order compiled once, reading the parts in the order ``projections`` and ``norms`` give).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.attention_backend import HeadShape, StepOps
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, SwiGLU
from pagedkv.model.projection import Projection, ProjectionBase


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.heads = HeadShape(config.num_heads, config.num_kv_heads, config.head_dim)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = Projection(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # Qwen3: Q and K heads normalised one by one before RoPE.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.family.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_proj = Projection(self.q_size, config.hidden_size)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        ops: StepOps,
    ) -> torch.Tensor:
        chained = ops.layer_chain(self.index, hidden, cos, sin, kv_cache)
        if chained is not None:
            return chained
        qkv = self.qkv_proj(ops.norm(self.input_norm, hidden))
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm)
        attn = ops.rope_attend(qkv, cos, sin, kv_cache, self.heads, self.scale)
        normed, hidden = ops.add_norm(self.post_attention_norm, hidden, self.o_proj, attn)
        return self.mlp.down_proj.added_to(hidden, ops.silu_mul(self.mlp, normed))

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """Q's and K's heads of ``qkv`` RMS-normalised in place (Qwen3)."""
        num_heads, num_kv_heads, head_dim = self.heads
        rows = qkv.shape[0]
        q = qkv[:, : self.q_size].view(rows, num_heads, head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(rows, num_kv_heads, head_dim)
        q.copy_(q_norm(q))
        k.copy_(k_norm(k))

    def projections(self) -> tuple[ProjectionBase, ...]:
        """The layer's projections in op order: QKV, output, gate/up, down."""
        return (self.qkv_proj, self.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)

    def norms(self) -> tuple[RMSNorm, ...]:
        """The layer's RMSNorms in op order: input, post-attention, then Q and K's (Qwen3)."""
        heads = () if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm)
        return (self.input_norm, self.post_attention_norm, *heads)
