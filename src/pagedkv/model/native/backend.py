"""The ``native`` backend: pagedkv's C kernels on the CPU (``native/__init__.py``), the CPU's
default. Its step's ops (``NativeStep``) are the torch-sdpa ones with three in C: attention
reads every sequence through its block table in one call (``pk_paged_attention``), RoPE and
the K/V store run in one call (``pk_rope_store``, fp32), and a step of decode tokens only runs
each layer in one call (``pk_decode_layer``: the decoder layer's own order compiled once, over
the parts ``DecoderLayer.projections`` and ``norms`` list). Same arithmetic as the torch ops
up to fp32 rounding (the tests); where the kernels cannot take a step (a dtype or head size
outside theirs) it runs on torch ops."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from pagedkv.model import native
from pagedkv.model.attention import paged_attention
from pagedkv.model.attention_backend import HeadShape
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.attention_plan import AttentionPlan
from pagedkv.model.kv_pool import KVCache, copy_pool_rows
from pagedkv.model.mla.native import NativeLatentStep
from pagedkv.model.native.projection import NativeProjection
from pagedkv.model.native.quant import NativeQuantProjection
from pagedkv.model.torch_backend import TorchStep
from pagedkv.pages.backends import NATIVE, BackendRule


class Chain(NamedTuple):
    """One layer's operands of ``pk_decode_layer``: its norms, projection formats and weight
    addresses, taken once when the backend is built (the modules stay as loaded from then on)."""

    first_norm: int  # addresses of the two RMSNorm weights, in op order
    second_norm: int
    eps: float
    formats: ctypes.Array  # the four projections' weight formats (0: fp32 rows)
    qkv: int
    qkv_bias: int | None
    out: int
    gate_up: int
    down: int
    intermediate: int
    qkv_width: int


class NativeStep(TorchStep):
    """``StepOps`` on the C kernels (``plan.kernels`` set) or, without them, torch's."""

    def __init__(self, plan: AttentionPlan, chains: list[Chain | None], heads: HeadShape) -> None:
        super().__init__(plan)
        self.chains, self.heads = chains, heads

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        heads: HeadShape,
        scale: float,
    ) -> torch.Tensor:
        """RoPE applied to ``qkv`` in place and K/V written to their slots in one call where the
        operands allow it (fp32, contiguous: six ops and two index copies fewer a layer), then
        the paged kernel; else ``TorchStep``'s."""
        plan = self.plan
        if plan.kernels is None or not _fp32_contiguous(qkv, cos, sin):
            return super().rope_attend(qkv, cos, sin, kv_cache, heads, scale)
        num_tokens, (num_heads, num_kv_heads, head_dim) = qkv.shape[0], heads
        k_cache, v_cache = kv_cache
        plan.kernels.pk_rope_store(
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            plan.slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            torch.get_num_threads(),
        )
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
        kv = (num_tokens, num_kv_heads, head_dim)
        k, v = qkv[:, q_size : q_size + kv_size].view(kv), qkv[:, q_size + kv_size :].view(kv)
        return paged_attention(q, k, v, kv_cache, plan, scale, written=True)

    def layer_chain(
        self,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
    ) -> torch.Tensor | None:
        """Layer ``index`` as one ``pk_decode_layer`` call: a step of decode tokens only, every
        part of the layer native. Updates ``hidden`` in place (the forward's own residual
        stream) and returns it."""
        plan, chain = self.plan, self.chains[index]
        if chain is None or not plan.native_decode_only or not hidden.is_contiguous():
            return None
        rows, width = hidden.shape
        k_cache, v_cache = kv_cache
        g, c, (num_heads, num_kv_heads, head_dim) = plan.native, chain, self.heads
        size = rows * (width + c.qkv_width + num_heads * head_dim + 3 * c.intermediate)
        work = plan.scratch("decode_layer", (size,), torch.float32)
        status = plan.kernels.pk_decode_layer(
            hidden.data_ptr(),
            rows,
            width,
            c.first_norm,
            c.second_norm,
            c.eps,
            c.formats,
            c.qkv,
            c.qkv_bias,
            c.out,
            c.gate_up,
            c.down,
            c.intermediate,
            num_heads,
            num_kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            plan.slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            g.tables.data_ptr(),
            g.tables.stride(0),
            g.ctx_lens.data_ptr(),
            plan.block_size,
            head_dim**-0.5,
            work.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("decode layer: no memory for a quantized projection's scratch")
        return hidden


def _fp32_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


class NativeBackend:
    """``AttentionBackend`` on pagedkv's C kernels for ``model`` (a ``CausalLM``) on the CPU;
    built once its weights are loaded."""

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.kernels = native.kernels() if device.type == "cpu" else None
        self.chains = [chain_of(layer) for layer in model.layers]
        config = model.config
        self.heads = HeadShape(config.num_heads, config.num_kv_heads, config.head_dim)

    @property
    def rule(self) -> BackendRule:
        return NATIVE

    def plan(
        self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int
    ) -> NativeStep | NativeLatentStep:
        model = self.model
        if model.config.mla is not None:  # latent pages: ``mla/native.py``
            return self._latent_step(meta, kv_caches, block_size)
        kernels = self.usable_kernels(kv_caches)
        if kernels is not None:  # C reads and writes where the slots say: check them first
            check_slots(meta, kv_caches[0][0].shape[0], block_size)
        plan = AttentionPlan(meta, block_size, model.dtype, kernels, model.device)
        return NativeStep(plan, self.chains, self.heads)

    def _latent_step(
        self, meta: AttentionMetadata, kv_caches: list[KVCache], block_size: int
    ) -> NativeLatentStep:
        """An MLA model's step: the torch plan (its prefill chunks' gathers), and the C
        kernel for the absorbed rows when it loaded (the slots checked first)."""
        if self.kernels is not None:
            check_slots(meta, kv_caches[0][0].shape[0], block_size)
        model = self.model
        plan = AttentionPlan(meta, block_size, model.dtype, None, model.device)
        return NativeLatentStep(plan, meta, self.kernels)

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

    def usable_kernels(self, kv_caches: list[KVCache]):
        """The kernels where attention may use them: queries and caches both fp32 or both
        bf16, contiguous caches, a head size of a multiple of 8 and at most 256; else None."""
        dtype, head_dim = self.model.dtype, self.model.config.head_dim
        if (
            self.kernels is None
            or dtype not in (torch.float32, torch.bfloat16)
            or kv_caches[0][0].dtype != dtype
            or not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
            or head_dim % 8
            or head_dim > native.MAX_HEAD_DIM
            or torch.compiler.is_compiling()
        ):
            return None
        return self.kernels


def chain_of(layer) -> Chain | None:
    """``pk_decode_layer``'s operands of ``layer`` (a ``DecoderLayer``), or None where a part
    is not on the native kernels or the chain lacks an op of the layer (Qwen3's q/k norms)."""
    projections, norms = layer.projections(), layer.norms()
    if not (
        len(projections) == 4  # none: MLA or the experts, which the chain does not compile
        and len(norms) == 2
        and all(n.kernels is not None for n in norms)
        and norms[0].eps == norms[1].eps
        and layer.mlp.kernels is not None
        and all(isinstance(p, NativeProjection | NativeQuantProjection) for p in projections)
    ):
        return None
    operands = [p.kernel_operand() for p in projections]
    formats = (ctypes.c_int * 4)(*(fmt for fmt, _ in operands))
    qkv, out, gate_up, down = (address for _, address in operands)
    bias = projections[0].bias
    return Chain(
        first_norm=norms[0].weight.data_ptr(),
        second_norm=norms[1].weight.data_ptr(),
        eps=norms[0].eps,
        formats=formats,
        qkv=qkv,
        qkv_bias=None if bias is None else bias.data_ptr(),
        out=out,
        gate_up=gate_up,
        down=down,
        intermediate=projections[3].in_features,
        qkv_width=projections[0].out_features,
    )


def check_slots(meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """ValueError unless every slot written and every block read lies in the pool (the torch
    path's index ops raise by themselves; the native kernels would touch other memory)."""
    slots, tables = meta.slot_mapping, meta.block_tables
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(f"slot_mapping outside the pool of {num_blocks * block_size} slots")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(f"block_tables name blocks outside the pool of {num_blocks}")
