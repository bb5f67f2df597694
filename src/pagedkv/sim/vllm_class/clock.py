"""A GPU's clock, op by op: what one kernel call of each kind costs, from a few fitted numbers.

Every price is physical, so that a clock fitted on some shapes and GPUs extends to others:
dimensionless efficiencies multiply the datasheet's rates (``GPUSpec``), fixed costs are
seconds. ``sim/vllm_class/fit.py`` fits the numbers to measured op times (``sim/vllm_class/data.py``);
``sim/vllm_class/cost.py`` sums the ops of one engine step.

- **GEMM** ``[M, K] x [K, N]`` (fp16/bf16): ``launch + softmax_p(bytes / (BW * bw_eff),
  flops / (peak * flops_eff))``, where ``softmax_p(a, b) = (a^p + b^p)^(1/p)``: a pure
  ``max`` is the roofline; a finite ``knee`` ``p`` is the efficiency lost near the ridge, where
  a GEMM is neither purely memory- nor compute-bound (tiles half-filled, pipelines not hidden).
- **Elementwise** kernels (norms, RoPE, activation, residual add, embedding gather): each kind
  ``launch + bytes / (BW * bw_eff)`` with its own achieved bandwidth (a reduction such as
  RMSNorm reaches less of it than a plain add).
- **Paged attention**, FlashAttention-2's structure with a block table: one thread block (CTA)
  per (sequence, KV head) and tile of ``ATTN_TILE_M`` queries; when those are too few to fill
  the GPU the KV range is split ("flash-decoding", ``fa_num_splits``) and a combine kernel
  (``split_s``) reduces the parts. A CTA walks its KV tiles one after another, so a wave of CTAs
  lasts its longest chain of tiles: ``waves * chain * tile_s``, next to the bandwidth floor
  ``kv bytes / (BW * bw_eff)``. ``tile_s`` is stored as an efficiency of one SM's share of the
  GPU's bandwidth (decode) or compute (prefill), so it scales to GPUs with other SM counts.
- **Step overhead** (scheduling, input preparation, sampling, output processing on the CPU):
  ``base_s + per_seq_s * num_seqs + per_worker_s * (tp - 1)`` (inputs go to every worker).
- **All-reduce** of tensor parallelism over the GPU's link (not fitted: no rows measure it):
  ring all-reduce, ``latency + 2 (tp - 1) / tp * bytes / (link bandwidth * efficiency)``.

Fields are plain floats so that a clock reads from and writes to JSON (``vllm_class/fit``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from pagedkv.sim.gpus import GPUSpec

ACT_BYTES = 2  # fp16 / bf16 activations and weights: what the measured kernels ran
ATTN_TILE_M = 64  # queries per CTA tile (the measured prefill times step every 64 tokens)
ATTN_TILE_N = 128  # KV tokens per tile a CTA loads at once
FA_MAX_SPLITS = 128
ALL_REDUCE_LATENCY_S = 10e-6  # assumed: one NCCL ring all-reduce call's fixed cost
ALL_REDUCE_EFFICIENCY = 0.7  # assumed: achieved / peak link bandwidth for a ring all-reduce
ELEMENTWISE_OPS = (
    "emb",
    "input_layernorm",
    "attn_rope",
    "post_attention_layernorm",
    "mlp_act",
    "add",
)


@dataclass(frozen=True)
class KernelPrice:
    """``launch_s`` + bytes over ``bw_eff`` of the datasheet bandwidth."""

    launch_s: float
    bw_eff: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.launch_s) and self.launch_s >= 0):
            raise ValueError(
                f"clock parameter launch_s must be finite and >= 0, got {self.launch_s!r}"
            )
        if not (math.isfinite(self.bw_eff) and self.bw_eff > 0):
            raise ValueError(f"clock parameter bw_eff must be finite and > 0, got {self.bw_eff!r}")


@dataclass(frozen=True)
class GPUClock:
    """The fitted numbers of one GPU (see the module docstring for each formula)."""

    gemm_launch_s: float = 5e-6
    gemm_bw_eff: float = 0.8
    gemm_flops_eff: float = 0.75
    gemm_knee: float = 1.5
    elementwise: dict[str, KernelPrice] = field(
        default_factory=lambda: {op: KernelPrice(3e-6, 0.5) for op in ELEMENTWISE_OPS}
    )
    decode_launch_s: float = 7e-6
    decode_split_s: float = 5e-6
    decode_bw_eff: float = 0.8
    decode_tile_eff: float = 0.3  # of one SM's share of the bandwidth
    decode_per_seq_s: float = 0.0
    prefill_launch_s: float = 15e-6
    prefill_split_s: float = 0.0
    prefill_tile_eff: float = 0.3  # of one SM's share of the peak compute
    step_base_s: float = 1e-3
    step_per_seq_s: float = 3e-5
    step_per_worker_s: float = 0.0  # each tensor-parallel worker beyond the first

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "elementwise":
                continue
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"clock parameter {f.name} must be finite and >= 0, got {v!r}")
        for name in (
            "gemm_bw_eff",
            "gemm_flops_eff",
            "decode_bw_eff",
            "decode_tile_eff",
            "prefill_tile_eff",
            "gemm_knee",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"clock parameter {name} must be > 0")
        missing = set(ELEMENTWISE_OPS) - set(self.elementwise)
        if missing:
            raise ValueError(f"clock: elementwise prices missing for {sorted(missing)}")


def soft_max(a: float, b: float, p: float) -> float:
    """``(a^p + b^p)^(1/p)``: ``max(a, b)`` as ``p`` grows, their sum at ``p = 1``."""
    hi = max(a, b)
    if hi <= 0:
        return 0.0
    return hi * ((a / hi) ** p + (b / hi) ** p) ** (1.0 / p)


def gemm_s(clock: GPUClock, gpu: GPUSpec, m: int, k: int, n: int) -> float:
    """One ``[m, k] x [k, n]`` GEMM (weights ``[k, n]`` read once)."""
    mem = ACT_BYTES * (k * n + m * k + m * n) / (gpu.mem_bandwidth_bytes_per_s * clock.gemm_bw_eff)
    comp = 2.0 * m * k * n / (gpu.peak_flops_per_s * clock.gemm_flops_eff)
    return clock.gemm_launch_s + soft_max(mem, comp, clock.gemm_knee)


def elementwise_s(clock: GPUClock, gpu: GPUSpec, op: str, num_bytes: float) -> float:
    price = clock.elementwise[op]
    return price.launch_s + num_bytes / (gpu.mem_bandwidth_bytes_per_s * price.bw_eff)


def fa_num_splits(num_ctas: int, num_kv_tiles: int, num_slots: int) -> int:
    """How many parts a FlashAttention-2 launch splits each CTA's KV range into: none when the
    CTAs fill 80 % of ``num_slots`` (the SM count, in the flash-attn build that was measured:
    its decode rows stop splitting at 22 sequences x 4 KV heads = 88 CTAs >= 0.8 x 108); else the fewest splits whose wave efficiency
    (CTAs in use / slots over whole waves) is within 85 % of the best, at most one per KV
    tile, skipping a count whose parts are no shorter than with one split fewer. (The rule of
    flash-attn's ``num_splits_heuristic``, restated.)"""
    if num_ctas >= 0.8 * num_slots or num_kv_tiles <= 1:
        return 1
    best = {}
    for s in range(1, min(num_kv_tiles, FA_MAX_SPLITS, num_slots) + 1):
        # a split that leaves every part as long as one split fewer does is not considered
        if s > 1 and math.ceil(num_kv_tiles / s) == math.ceil(num_kv_tiles / (s - 1)):
            continue
        units = num_ctas * s
        best[s] = units / (math.ceil(units / num_slots) * num_slots)
    top = max(best.values())
    return min(s for s, eff in best.items() if eff >= 0.85 * top)


def decode_attention_s(
    clock: GPUClock,
    gpu: GPUSpec,
    num_seqs: int,
    context_tokens: float,
    kv_heads: int,
    head_dim: float,
    read_tokens: float | None = None,
) -> float:
    """One layer's decode attention: ``num_seqs`` sequences of ``context_tokens`` each (mean),
    ``kv_heads`` KV heads of ``head_dim`` (all query heads of a group share one CTA).
    ``read_tokens``: KV tokens read in all (whole blocks), default ``num_seqs * context``."""
    if num_seqs <= 0:
        return 0.0
    slots = gpu.num_sms  # what the measured flash-attn build hands its split rule
    ctas = num_seqs * kv_heads
    tiles = max(1, math.ceil(context_tokens / ATTN_TILE_N))
    splits = fa_num_splits(ctas, tiles, slots)
    waves = math.ceil(ctas * splits / slots)
    head_token_bytes = 2 * head_dim * ACT_BYTES  # K and V of one head and token
    sm_bandwidth = gpu.mem_bandwidth_bytes_per_s / gpu.num_sms
    tile_s = ATTN_TILE_N * head_token_bytes / (sm_bandwidth * clock.decode_tile_eff)
    walk = waves * math.ceil(tiles / splits) * tile_s
    total = num_seqs * context_tokens if read_tokens is None else read_tokens
    floor = (
        total * kv_heads * head_token_bytes / (gpu.mem_bandwidth_bytes_per_s * clock.decode_bw_eff)
    )
    split = clock.decode_split_s if splits > 1 else 0.0
    # both limits bind near the crossover (soft, so a fit sees both terms everywhere)
    return (
        clock.decode_launch_s
        + split
        + clock.decode_per_seq_s * num_seqs
        + soft_max(walk, floor, 4.0)
    )


def prefill_attention_s(
    clock: GPUClock,
    gpu: GPUSpec,
    num_seqs: int,
    chunk_tokens: float,
    cached_tokens: float,
    query_heads: int,
    head_dim: int,
) -> float:
    """One layer's prefill attention: ``num_seqs`` chunks of ``chunk_tokens`` new queries
    (mean) after ``cached_tokens`` cached ones, causal within the chunk, ``query_heads``
    heads of ``head_dim``. The longest CTA walks the cached tiles and the chunk's own."""
    if num_seqs <= 0 or chunk_tokens <= 0:
        return 0.0
    slots = gpu.num_sms
    m_tiles = math.ceil(chunk_tokens / ATTN_TILE_M)
    ctas = num_seqs * m_tiles * query_heads
    kv_tiles = max(1, math.ceil((cached_tokens + chunk_tokens) / ATTN_TILE_N))
    splits = fa_num_splits(ctas, kv_tiles, slots)
    chain = math.ceil((math.ceil(cached_tokens / ATTN_TILE_M) + m_tiles) / splits)
    tile_flops = 4.0 * ATTN_TILE_M * ATTN_TILE_M * head_dim  # QK^T and PV of one tile pair
    sm_flops = gpu.peak_flops_per_s / gpu.num_sms
    tile_s = tile_flops / (sm_flops * clock.prefill_tile_eff)
    waves = math.ceil(ctas * splits / slots)
    split = clock.prefill_split_s if splits > 1 else 0.0
    return clock.prefill_launch_s + split + waves * chain * tile_s


def step_overhead_s(clock: GPUClock, num_seqs: int, tp: int = 1) -> float:
    return clock.step_base_s + clock.step_per_seq_s * num_seqs + clock.step_per_worker_s * (tp - 1)


def all_reduce_s(gpu: GPUSpec, num_bytes: float, tp: int) -> float:
    """A ring all-reduce of ``num_bytes`` over ``tp`` GPUs on the GPU's link (0 at tp = 1)."""
    if tp <= 1:
        return 0.0
    link = gpu.link_bytes_per_s * ALL_REDUCE_EFFICIENCY
    return ALL_REDUCE_LATENCY_S + 2 * (tp - 1) / tp * num_bytes / link
