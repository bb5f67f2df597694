"""The one decoder layer of every family pagedkv runs (Llama, Mistral, Qwen2, Qwen3, DeepSeek-V2
and -V3), over the paged KV cache. Its op order is written here and nowhere else::

    x = norm(h)                                  input RMSNorm
    a = attention(x)                             MHA or MLA, by the family:
        qkv = qkv_proj(x)                        MHA: Q, K, V in one product (+ bias: Qwen2)
        q, k = q_norm(q), k_norm(k)              per-head RMSNorm (Qwen3), before RoPE
        a = rope_attend(qkv)                     RoPE, this step's K/V stored, paged attention
      or a = mla(x)                              MLA (``mla/attention.py``): queries and the
                                                 latent record, ``mla_attend`` over latents
    x, h = add_norm(h + o_proj(a))               residual add, post-attention RMSNorm
    h = h + mlp(x)                               SwiGLU: down_proj(silu_mul(gate_up_proj(x)));
                                                 or the experts (``moe.py``), the second add

A backend supplies the *ops* (``attention_backend.StepOps``: the norms, the attention with its
store, the add + norm, SiLU * up), fused where it has kernels; a family differs by a row of
``config.ARCHITECTURES`` (biases, q/k norms, the GGUF RoPE layout, the attention kind) and its
shape (the experts), never by code. One backend may run a whole layer in one call
(``layer_chain``: the native C decode chain, which is this same order compiled once, reading
the parts in the order ``projections`` and ``norms`` give; MHA and SwiGLU layers only).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model.attention_backend import HeadShape, StepOps
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, SwiGLU
from pagedkv.model.mla.attention import MLAAttention
from pagedkv.model.moe import MoE
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
        # The attention part: MHA's projection here, or MLA's part of its own (``mla/``).
        self.mla: MLAAttention | None = None
        self.qkv_proj: Projection | None = None
        attention_width = self.q_size
        if config.mla is not None:
            self.mla = MLAAttention(config)
            attention_width = config.num_heads * config.mla.v_head_dim
        else:
            self.qkv_proj = Projection(
                config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
            )
        # Qwen3: Q and K heads normalised one by one before RoPE.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.family.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_proj = Projection(attention_width, config.hidden_size)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The MLP part: SwiGLU, or the experts where the shape routes this layer.
        self.mlp: SwiGLU | MoE = SwiGLU(config.hidden_size, config.intermediate_size)
        if config.moe is not None and config.moe.is_moe_layer(index):
            self.mlp = MoE(config)

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
        x = ops.norm(self.input_norm, hidden)
        if self.mla is not None:
            attn = self.mla(x, cos, sin, kv_cache, ops)
        else:
            attn = self._mha(x, cos, sin, kv_cache, ops)
        normed, hidden = ops.add_norm(self.post_attention_norm, hidden, self.o_proj, attn)
        if isinstance(self.mlp, MoE):
            return self.mlp(normed).add_(hidden)
        return self.mlp.down_proj.added_to(hidden, ops.silu_mul(self.mlp, normed))

    def _mha(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        ops: StepOps,
    ) -> torch.Tensor:
        """MHA's attention part of the normed ``x``: QKV, the Qwen3 head norms, RoPE + store +
        paged attention."""
        assert self.qkv_proj is not None  # an MHA layer
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, self.q_norm, self.k_norm)
        return ops.rope_attend(qkv, cos, sin, kv_cache, self.heads, self.scale)

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """Q's and K's heads of ``qkv`` RMS-normalised in place (Qwen3)."""
        num_heads, num_kv_heads, head_dim = self.heads
        rows = qkv.shape[0]
        q = qkv[:, : self.q_size].view(rows, num_heads, head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(rows, num_kv_heads, head_dim)
        q.copy_(q_norm(q))
        k.copy_(k_norm(k))

    def projections(self) -> tuple[ProjectionBase, ...]:
        """The layer's projections in op order: QKV, output, gate/up, down; empty for a layer
        of MLA or experts (the chain compiles neither)."""
        if self.qkv_proj is None or not isinstance(self.mlp, SwiGLU):
            return ()
        return (self.qkv_proj, self.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)

    def norms(self) -> tuple[RMSNorm, ...]:
        """The layer's RMSNorms in op order: input, post-attention, then Q and K's (Qwen3)."""
        heads = () if self.q_norm is None or self.k_norm is None else (self.q_norm, self.k_norm)
        return (self.input_norm, self.post_attention_norm, *heads)
