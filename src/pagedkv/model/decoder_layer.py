"""One decoder layer of the Llama family: attention over the paged KV cache, then SwiGLU,
each around a residual add. Three ways through it, the same arithmetic up to fp32 rounding:
torch ops (any dtype), pagedkv's kernels op by op (fp32), and, for a step of decode tokens
only, the whole layer as one native call (``native.pk_decode_layer``)."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagedkv.model.attention import AttentionPlan, paged_attention
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.layers import RMSNorm, SwiGLU, apply_rotary
from pagedkv.model.native_projection import NativeProjection
from pagedkv.model.native_quant import NativeQuantProjection
from pagedkv.model.projection import Projection
from pagedkv.model.triton.attention import TritonPlan


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
        # Every part native (prepare_fused_decode, from load_weights): a decode-only step runs
        # the layer in one call, on the projections' kernel operands taken once there.
        self.fused_decode = False
        self._operands: tuple | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        plan: AttentionPlan | TritonPlan,
    ) -> torch.Tensor:
        if isinstance(plan, TritonPlan):  # the GPU backend: its kernels write K/V themselves
            q, k, v = self.attention_inputs(hidden, cos, sin)
            return self.attention_outputs(hidden, plan.attend(q, k, v, kv_cache, self.scale))
        if plan.native_decode_only and self.fused_decode and hidden.is_contiguous():
            return self._decode_in_one_call(hidden, cos, sin, kv_cache, plan)
        qkv = self.qkv_proj(self.input_norm(hidden))
        written = (
            plan.kernels is not None
            and qkv.dtype == torch.float32
            and qkv.is_contiguous()
            and cos.is_contiguous()
            and sin.is_contiguous()
        )
        if written:
            q, k, v = self._rotated_and_stored(qkv, cos, sin, kv_cache, plan)
        else:
            q, k, v = self._rotated(qkv, cos, sin)
        attn = paged_attention(q, k, v, kv_cache, plan, self.scale, written=written)
        return self.attention_outputs(hidden, attn)

    def _decode_in_one_call(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """The whole layer as ``native.pk_decode_layer`` (a step of decode tokens only, every
        part of the layer native: ``fused_decode``). Updates ``hidden`` in place (the
        forward's own residual stream) and returns it."""
        rows, width = hidden.shape
        k_cache, v_cache = kv_cache
        g, inter = plan.native, self.mlp.down_proj.in_features
        size = rows * (width + self.qkv_proj.out_features + self.q_size + 3 * inter)
        work = plan.scratch("decode_layer", (size,), torch.float32)
        bias = self.qkv_proj.bias
        formats, w_qkv, w_o, w_gu, w_down = self._operands
        status = plan.kernels.pk_decode_layer(
            hidden.data_ptr(), rows, width, self.input_norm.weight.data_ptr(),
            self.post_attention_norm.weight.data_ptr(), self.input_norm.eps, formats,
            w_qkv, None if bias is None else bias.data_ptr(), w_o, w_gu, w_down,
            inter, self.num_heads, self.num_kv_heads,
            self.head_dim, cos.data_ptr(), sin.data_ptr(), plan.slot_mapping.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), g.tables.data_ptr(), g.tables.stride(0),
            g.ctx_lens.data_ptr(), plan.block_size, self.scale, work.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("decode layer: no memory for a quantized projection's scratch")
        return hidden

    def _rotated_and_stored(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attention_inputs`` for the native kernels (fp32 everything, the caller checks):
        RoPE applied to ``qkv`` in place and K/V written to their slots in one call (six ops
        and two index copies fewer a layer). Returns views of ``qkv``."""
        num_tokens = qkv.shape[0]
        k_cache, v_cache = kv_cache
        plan.kernels.pk_rope_store(
            qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
            plan.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            num_tokens, self.num_heads, self.num_kv_heads, self.head_dim,
            torch.get_num_threads(),
        )  # fmt: skip
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :]
        shape = (num_tokens, self.num_kv_heads, self.head_dim)
        return q, k.view(shape), v.view(shape)

    # The two halves around attention are pure functions of their tensors (no cache, no plan):
    # ``benchmarks/bench_compile.py --scope halves`` compiles them alone (it did not pay).
    def attention_inputs(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[T, Hq, D]``, K and V ``[T, Hkv, D]`` of the layer's input, RoPE applied."""
        return self._rotated(self.qkv_proj(self.input_norm(hidden)), cos, sin)

    def _rotated(
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

    def prepare_fused_decode(self) -> None:
        """Turn the one-call decode path on where ``all_native()`` (after ``load_weights``,
        which calls this), taking the projections' formats and weight addresses once: the
        modules and their storage stay as loaded from then on."""
        self.fused_decode = self.all_native()
        self._operands = None
        if self.fused_decode:
            projections = (self.qkv_proj, self.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
            operands = [p.kernel_operand() for p in projections]
            formats = (ctypes.c_int * 4)(*(fmt for fmt, _ in operands))
            self._operands = (formats, *(address for _, address in operands))

    def all_native(self) -> bool:
        """Every part on the native kernels (after ``load_weights``): a decode-only step may
        then run the layer in one call."""
        return (
            self.input_norm.kernels is not None
            and self.post_attention_norm.kernels is not None
            and self.input_norm.eps == self.post_attention_norm.eps
            and self.mlp.kernels is not None
            and all(
                isinstance(p, NativeProjection | NativeQuantProjection)
                for p in (self.qkv_proj, self.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
            )
        )
