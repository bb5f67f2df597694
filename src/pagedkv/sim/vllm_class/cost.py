"""A step's time from a fitted GPU clock: the ops of every layer, priced one by one.

One engine step of ``StepShape`` runs, per layer and on each of ``tp`` GPUs: the QKV, output,
up (gate + up when gated) and down GEMMs over all ``num_batched_tokens`` rows, two RMSNorms,
RoPE, the MLP activation and the residual add, decode attention over the decode sequences'
contexts, prefill attention over the prompt chunks, and (``tp > 1``) two all-reduces of the
hidden states; once a step: the embedding gather, the LM head over the sampled rows and the CPU
overhead. ``sim/vllm_class/clock.py`` prices each op.

**Block size and backend.** The measured attention rows all ran FlashAttention with 16-token
blocks. Beyond a contiguous kernel, a paged one pays a walk per block (a table lookup and a
dependent load), so it costs ``C * (1 + f * 16 / B)`` where ``C`` is the contiguous kernel's
time and ``f`` the backend's overhead at B = 16. The PagedAttention paper's Fig. 18a measured
its (v0) paged kernel 20-26 % slower than FasterTransformer's contiguous one at B = 16:
``f = PAGED_OVERHEAD_AT_16`` for ``vllm``. Other backends' ``f`` scale with their assumed
per-block iteration latency (``sim/costs/kernel.KERNELS``: flash-attn 1/6 of v0's, FlashInfer
1/15, ...), ``contiguous`` has none. Decode attention at B on ``backend`` is therefore the
fitted time x ``(1 + f_backend * 16 / B) / (1 + f_flash-attn)``
(``block_walk_factor``). Whole blocks are read (the tail's empty slots too).

A model whose shape lacks the hidden or MLP width (or has MLA) is priced as one GEMM per layer
holding ``num_params / num_layers`` weights (a mixture of experts: every expert read, as the
roofline does). Decode attention reads the KV record's bytes (a quantized KV dtype reads fewer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.costs.kernel import get_kernel
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.vllm_class import clock as gc

PAGED_OVERHEAD_AT_16 = 0.23  # the paper's 20-26 %, its middle: the v0 kernel's
MEASURED_BACKEND = "flash-attn"  # the kernel the attention rows timed


def paged_overhead_at_16(backend: str) -> float:
    """``f`` of ``backend`` (module docstring): the v0 kernel's 0.23 scaled by the backend's
    per-block iteration latency; 0 for a contiguous kernel."""
    kernel, v0 = get_kernel(backend), get_kernel("vllm")
    if not kernel.paged:
        return 0.0
    return PAGED_OVERHEAD_AT_16 * kernel.iteration_latency_s / v0.iteration_latency_s


def block_walk_factor(block_size: int, backend: str = MEASURED_BACKEND) -> float:
    """Decode attention at ``block_size`` on ``backend`` relative to the measured kernel."""
    f = paged_overhead_at_16(backend)
    return (1.0 + f * 16.0 / max(1, block_size)) / (1.0 + paged_overhead_at_16(MEASURED_BACKEND))


def layer_gemms_s(md: ModelCost, c: gc.GPUClock, g: GPUSpec, m: int, tp: int = 1) -> float:
    """One layer's projections over ``m`` rows on each of ``tp`` GPUs: QKV, output, gate + up
    (up alone without a gate) and down, each ``vllm_class/clock.gemm_s``; a model whose shape lacks
    the widths (or MLA) as one GEMM holding ``num_params / num_layers`` weights."""
    h = md.hidden_size
    if not (h and md.intermediate_size and md.head_dim and md.num_query_heads):
        params = md.num_params / max(1, md.num_layers) / tp
        k = h or int(math.sqrt(params))
        return gc.gemm_s(c, g, m, k, max(1, int(params / k)))
    q, kv, hd, inter = md.num_query_heads, md.num_kv_heads, md.head_dim, md.intermediate_size
    return (
        gc.gemm_s(c, g, m, h, (q + 2 * kv) * hd // tp)
        + gc.gemm_s(c, g, m, q * hd // tp, h)
        + gc.gemm_s(c, g, m, h, (2 if md.gated_mlp else 1) * inter // tp)
        + gc.gemm_s(c, g, m, inter // tp, h)
    )


@dataclass(frozen=True)
class FittedCostModel:
    """``CostModel`` over ``clock`` (fitted on ``gpu``'s kind). ``backend`` names the attention
    kernel (``sim/costs/kernel.KERNELS``): a paged one pays the block walk, ``contiguous`` does
    not; ``tp`` GPUs split every layer's matrices and heads."""

    model: ModelCost
    gpu: GPUSpec
    clock: gc.GPUClock
    backend: str = MEASURED_BACKEND
    tp: int = 1
    source: str = ""

    @property
    def paged(self) -> bool:
        return get_kernel(self.backend).paged

    def __post_init__(self) -> None:
        get_kernel(self.backend)  # UsageError for an unknown one
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise UsageError(f"tensor parallelism must be a whole number >= 1, got {self.tp!r}")

    def _gemms(self, m: int) -> float:
        return layer_gemms_s(self.model, self.clock, self.gpu, m, self.tp)

    def _elementwise(self, m: int) -> float:
        md, c, g, tp, b = self.model, self.clock, self.gpu, self.tp, gc.ACT_BYTES
        h = md.hidden_size or 0
        heads = (md.num_query_heads + md.num_kv_heads) * md.head_dim // tp
        act = (3 if md.gated_mlp else 2) * b * m * (md.intermediate_size or 0) // tp
        return (
            gc.elementwise_s(c, g, "input_layernorm", 2 * b * m * h)
            + gc.elementwise_s(c, g, "post_attention_layernorm", 2 * b * m * h)
            + gc.elementwise_s(c, g, "attn_rope", 2 * b * m * heads)
            + gc.elementwise_s(c, g, "mlp_act", act)
            + gc.elementwise_s(c, g, "add", 3 * b * m * h)
        )

    def attention_s(self, shape: StepShape) -> float:
        """One layer's attention of the step (decode and prefill parts)."""
        md, c, g, tp = self.model, self.clock, self.gpu, self.tp
        kv_heads = max(1, md.num_kv_heads // tp)
        q_heads = max(1, md.num_query_heads // tp)
        # decode reads bytes: the head width that gives one token's record at 16-bit K and V
        # (a quantized KV reads fewer; an MLA latent is one "head" of its own width)
        per_head = md.kv_record_bytes / (max(1, md.num_layers) * max(1, md.num_kv_heads))
        kv_hd = per_head / (2 * gc.ACT_BYTES)
        hd = md.head_dim or round(kv_hd) or 128
        b = max(1, shape.block_size)
        t = 0.0
        d = shape.num_decode_seqs
        if d:
            ctx = shape.decode_kv_tokens / d if shape.decode_kv_tokens else 1.0
            read = d * math.ceil(ctx / b) * b if self.paged else d * ctx
            t += gc.decode_attention_s(c, g, d, ctx, kv_heads, kv_hd, read)
            t *= block_walk_factor(b, self.backend)
        p = shape.num_seqs - d
        if p > 0:
            chunk = (shape.num_batched_tokens - d) / p
            cached = max(0.0, (shape.kv_read_tokens - shape.decode_kv_tokens) / p - chunk)
            t += gc.prefill_attention_s(c, g, p, chunk, cached, q_heads, hd)
        return t

    def step_time_s(self, shape: StepShape) -> float:
        md, c, g, tp = self.model, self.clock, self.gpu, self.tp
        m = shape.num_batched_tokens
        if m <= 0:
            return gc.step_overhead_s(c, shape.num_seqs, tp)
        h = md.hidden_size or 0
        layer = self._gemms(m) + self._elementwise(m) + self.attention_s(shape)
        layer += 2 * gc.all_reduce_s(g, gc.ACT_BYTES * m * h, tp)
        sampled = max(1, shape.num_seqs)
        head = gc.gemm_s(c, g, sampled, h, md.vocab_size // tp) if h and md.vocab_size else 0.0
        emb = gc.elementwise_s(c, g, "emb", 2 * gc.ACT_BYTES * m * h)
        return md.num_layers * layer + head + emb + gc.step_overhead_s(c, shape.num_seqs, tp)


def fitted_cost_model(
    model: str, gpu: str, backend: str = "flash-attn", tp: int = 1, kv_dtype: str | None = None
) -> FittedCostModel:
    """The fitted clock of preset (or config) ``model`` on preset ``gpu``, shipped clock."""
    from pagedkv.pages.sources import load_shape
    from pagedkv.sim.clock_presets import clock_for
    from pagedkv.sim.gpus import get_gpu

    spec = get_gpu(gpu)
    clock, source = clock_for(spec)
    cost = ModelCost.from_shape(load_shape(model), kv_dtype)
    return FittedCostModel(cost, spec, clock, backend, tp, source)
