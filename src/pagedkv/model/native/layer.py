"""The native backend's fused forms of a decoder layer (``AttentionPlan.run_layer`` with the C
kernels): a step of decode tokens only runs the whole layer in one call
(``pk_decode_layer``), any other step RoPE and the K/V store in one (``pk_rope_store``), then
the paged kernel. Same arithmetic as the layer's torch ops up to fp32 rounding (the tests)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from pagedkv.model.attention import paged_attention
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.native.projection import NativeProjection
from pagedkv.model.native.quant import NativeQuantProjection

if TYPE_CHECKING:
    from pagedkv.model.attention_plan import AttentionPlan
    from pagedkv.model.decoder_layer import DecoderLayer


def run_native_layer(
    plan: AttentionPlan,
    layer: DecoderLayer,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVCache,
) -> torch.Tensor:
    """The layer's output on the C kernels (``plan.kernels`` set): one call for a decode step
    where every part is native, else the projections, RoPE + store in one call where the
    operands allow it (fp32, contiguous), and the paged kernel."""
    if plan.native_decode_only and layer.fused_decode and hidden.is_contiguous():
        return _decode_in_one_call(plan, layer, hidden, cos, sin, kv_cache)
    qkv = layer.qkv_proj(layer.input_norm(hidden))
    written = (
        qkv.dtype == torch.float32
        and qkv.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
    )
    if written:
        q, k, v = _rotated_and_stored(plan, layer, qkv, cos, sin, kv_cache)
    else:
        q, k, v = layer.rotated(qkv, cos, sin)
    attn = paged_attention(q, k, v, kv_cache, plan, layer.scale, written=written)
    return layer.attention_outputs(hidden, attn)


def _decode_in_one_call(
    plan: AttentionPlan,
    layer: DecoderLayer,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVCache,
) -> torch.Tensor:
    """The whole layer as ``native.pk_decode_layer`` (a step of decode tokens only, every
    part of the layer native: ``layer.fused_decode``). Updates ``hidden`` in place (the
    forward's own residual stream) and returns it."""
    rows, width = hidden.shape
    k_cache, v_cache = kv_cache
    g, inter = plan.native, layer.mlp.down_proj.in_features
    size = rows * (width + layer.qkv_proj.out_features + layer.q_size + 3 * inter)
    work = plan.scratch("decode_layer", (size,), torch.float32)
    bias = layer.qkv_proj.bias
    formats, w_qkv, w_o, w_gu, w_down = layer.native_operands
    status = plan.kernels.pk_decode_layer(
        hidden.data_ptr(), rows, width, layer.input_norm.weight.data_ptr(),
        layer.post_attention_norm.weight.data_ptr(), layer.input_norm.eps, formats,
        w_qkv, None if bias is None else bias.data_ptr(), w_o, w_gu, w_down,
        inter, layer.num_heads, layer.num_kv_heads,
        layer.head_dim, cos.data_ptr(), sin.data_ptr(), plan.slot_mapping.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), g.tables.data_ptr(), g.tables.stride(0),
        g.ctx_lens.data_ptr(), plan.block_size, layer.scale, work.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("decode layer: no memory for a quantized projection's scratch")
    return hidden


def _rotated_and_stored(
    plan: AttentionPlan,
    layer: DecoderLayer,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVCache,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer.attention_inputs`` for the native kernels (fp32 everything, the caller checks):
    RoPE applied to ``qkv`` in place and K/V written to their slots in one call (six ops and
    two index copies fewer a layer). Returns views of ``qkv``."""
    num_tokens = qkv.shape[0]
    k_cache, v_cache = kv_cache
    plan.kernels.pk_rope_store(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
        plan.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        num_tokens, layer.num_heads, layer.num_kv_heads, layer.head_dim,
        torch.get_num_threads(),
    )  # fmt: skip
    q_size, kv_size = layer.q_size, layer.kv_size
    q = qkv[:, :q_size].view(num_tokens, layer.num_heads, layer.head_dim)
    k = qkv[:, q_size : q_size + kv_size]
    v = qkv[:, q_size + kv_size :]
    shape = (num_tokens, layer.num_kv_heads, layer.head_dim)
    return q, k.view(shape), v.view(shape)


def prepare_fused_decode(layer: DecoderLayer) -> None:
    """Turn the one-call decode path on where ``all_native(layer)`` (``load_weights`` calls
    this), taking the projections' formats and weight addresses once: the modules and their
    storage stay as loaded from then on."""
    layer.fused_decode = all_native(layer)
    layer.native_operands = None
    if layer.fused_decode:
        projections = (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        operands = [p.kernel_operand() for p in projections]
        formats = (ctypes.c_int * 4)(*(fmt for fmt, _ in operands))
        layer.native_operands = (formats, *(address for _, address in operands))


def all_native(layer: DecoderLayer) -> bool:
    """Every part of ``layer`` on the native kernels (after ``load_weights``): a decode-only
    step may then run the layer in one call."""
    return (
        layer.input_norm.kernels is not None
        and layer.post_attention_norm.kernels is not None
        and layer.input_norm.eps == layer.post_attention_norm.eps
        and layer.mlp.kernels is not None
        and all(
            isinstance(p, NativeProjection | NativeQuantProjection)
            for p in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        )
    )
