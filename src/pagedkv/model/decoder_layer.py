"""One decoder layer of the Llama family: attention over the paged KV cache, then SwiGLU,
each around a residual add. The attention backend's step plan (``attention_backend.py``) may
run the whole layer in its own fused form (the native C kernels do); otherwise the layer
computes Q, K and V with torch ops and the plan attends."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.model.attention_backend import StepAttention
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, SwiGLU, apply_rotary
from pagedkv.model.projection import Projection


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = Projection(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Projection(self.q_size, config.hidden_size)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        # The native backend's one-call decode (``native/layer.prepare_fused_decode``, from
        # load_weights): every part native, the projections' kernel operands taken once.
        self.fused_decode = False
        self.native_operands: tuple[Any, ...] | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        plan: StepAttention,
    ) -> torch.Tensor:
        fused = plan.run_layer(self, hidden, cos, sin, kv_cache)
        if fused is not None:
            return fused
        q, k, v = self.attention_inputs(hidden, cos, sin)
        return self.attention_outputs(hidden, plan.attend(q, k, v, kv_cache, self.scale))

    # The two halves around attention are pure functions of their tensors (no cache, no plan):
    # ``benchmarks/bench_compile.py --scope halves`` compiles them alone (it did not pay).
    def attention_inputs(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[T, Hq, D]``, K and V ``[T, Hkv, D]`` of the layer's input, RoPE applied."""
        return self.rotated(self.qkv_proj(self.input_norm(hidden)), cos, sin)

    def rotated(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K and V of a QKV product, RoPE applied by torch ops (K, Q new tensors)."""
        num_tokens = qkv.shape[0]
        # Slices, not Tensor.split: its Python wrapper costs ~15 us a call at batch 1.
        qk, v = qkv[:, : self.q_size + self.kv_size], qkv[:, self.q_size + self.kv_size :]
        # Q and K heads rotated in one pass (half the elementwise ops of two calls).
        heads = self.num_heads + self.num_kv_heads
        qk = apply_rotary(qk.view(num_tokens, heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim)

    def attention_outputs(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input and its attention ``[T, Hq * D]``."""
        hidden = self.o_proj.added_to(hidden, attn)
        return self.mlp.added_to(hidden, self.post_attention_norm(hidden))
