"""Step time without a model: a roofline over the GPU's spec plus a fixed per-step overhead.

One step reads every weight once, reads the KV of every context token its sequences attend to,
writes the KV of the new tokens, and spends ``2 * num_params`` FLOPs per new token plus the
attention FLOPs (``4 * num_layers * q_dim`` per query-key pair: QK^T and PV, 2 FLOPs a
multiply-add). The step takes the longer of bytes / bandwidth and FLOPs / peak compute, plus
``step_overhead_s`` (scheduling, sampling, kernel launches).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from pagedkv.pages.layout import KVLayout, layout_from_shape
from pagedkv.pages.shape import ModelShape
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.gpus import GPUSpec


class CostModel(Protocol):
    def step_time_s(self, shape: StepShape) -> float:
        """Seconds one step of ``shape`` takes (> 0)."""
        ...


@dataclass(frozen=True)
class LinearCostModel:
    """``per_step_s + per_token_s * num_batched_tokens``: for hand-computed tests."""

    per_step_s: float
    per_token_s: float = 0.0

    def step_time_s(self, shape: StepShape) -> float:
        return self.per_step_s + self.per_token_s * shape.num_batched_tokens


@dataclass(frozen=True)
class ModelCost:
    """The numbers of a model a roofline needs (from the planner's ``KVLayout``)."""

    name: str
    weight_bytes: int
    num_params: int
    kv_record_bytes: int  # one token's K and V over all layers
    attention_flops_per_pair: int  # 4 * num_layers * query width
    # The attention grid (0 = unknown; the kernel-aware cost then counts one walk per layer):
    num_layers: int = 0
    num_query_heads: int = 0
    num_kv_heads: int = 0  # MLA: 1 (one latent per layer)
    # The layer's matrices, for the fitted clock (0 = unknown: priced from num_params)
    head_dim: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    gated_mlp: bool = True

    @classmethod
    def from_shape(cls, shape: ModelShape, kv_dtype: str | None = None) -> ModelCost:
        """``from_layout`` of the shape's layout, plus its matrices' widths. An OPT-style
        model (no gate) has an up and a down matrix; Llama-style ones gate + up and down."""
        base = cls.from_layout(layout_from_shape(shape, kv_dtype))
        if shape.attention != "mha":
            return base
        gated = not (shape.architecture or "").upper().startswith("OPT")
        return replace(
            base,
            head_dim=shape.head_dim,
            hidden_size=shape.hidden_size or 0,
            intermediate_size=shape.intermediate_size or 0,
            vocab_size=shape.vocab_size or 0,
            gated_mlp=gated,
        )

    @classmethod
    def from_layout(cls, layout: KVLayout, query_dim: int | None = None) -> ModelCost:
        """``query_dim`` (heads x head dim of the queries) defaults to the layout's, which its
        model shape states (``pages/sources.py``); a layout built from record bytes alone
        does not know it and falls back to the KV width (low for GQA: attention undercounted).
        ValueError if the layout does not know its parameter count."""
        if layout.num_params is None or layout.weight_bytes is None:
            raise ValueError(
                f"model {layout.name!r}: the roofline needs num_params (add it to the config)"
            )
        if query_dim is None:
            query_dim = layout.query_dim or layout.num_kv_heads * layout.head_dim
        kv_heads = layout.num_kv_heads if layout.attention == "mha" else 1
        query_heads = query_dim // layout.head_dim if layout.head_dim else kv_heads
        return cls(
            layout.name,
            layout.weight_bytes,
            layout.num_params,
            layout.record_bytes,
            4 * layout.num_layers * query_dim,
            layout.num_layers,
            max(query_heads, kv_heads),
            kv_heads,
        )


@dataclass(frozen=True)
class RooflineCostModel:
    model: ModelCost
    gpu: GPUSpec
    step_overhead_s: float = 0.002

    def __post_init__(self) -> None:
        if self.step_overhead_s < 0:
            raise ValueError(f"step overhead must be >= 0, got {self.step_overhead_s}")

    def step_time_s(self, shape: StepShape) -> float:
        m = self.model
        kv_bytes = (shape.kv_read_tokens + shape.num_batched_tokens) * m.kv_record_bytes
        memory_s = (m.weight_bytes + kv_bytes) / self.gpu.mem_bandwidth_bytes_per_s
        flops = 2 * m.num_params * shape.num_batched_tokens
        flops += m.attention_flops_per_pair * shape.attention_pairs
        compute_s = flops / self.gpu.peak_flops_per_s
        return self.step_overhead_s + max(memory_s, compute_s)


def kv_pool_bytes(
    gpu: GPUSpec, weight_bytes: int, utilization: float = 0.9, activation_bytes: int = 4 * 2**30
) -> int:
    """The KV pool a GPU leaves: memory x utilization - weights - activation reserve.
    ValueError when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"GPU memory utilization must be in (0, 1], got {utilization}")
    pool = int(gpu.memory_bytes * utilization) - weight_bytes - activation_bytes
    if pool <= 0:
        raise ValueError(
            f"{gpu.name}: {gpu.memory_bytes * utilization / 1e9:.1f} GB usable leaves no KV pool "
            f"after {weight_bytes / 1e9:.1f} GB of weights and {activation_bytes / 1e9:.1f} GB "
            "of activations"
        )
    return pool
