"""How DeepSeek's tensors land in a layer (``weights.load_layer`` loads the rest): the MLA
part's tables and its weights per head, the experts' stacks and their router.

Canonical names (after ``layers.{i}.``; ``model/safetensors.py`` and ``model/gguf.py`` map the
files' names to them): ``q_proj`` (no q low rank) or ``q_a_proj``, ``q_a_norm``, ``q_b_proj``;
``kv_a_proj`` (the KV compression with k_pe's rows), ``kv_a_norm``, ``kv_b_proj``; the router
``router.weight`` (+ ``router.bias``, V3's score correction), ``experts.{e}.{gate,up,down}_proj``
and ``shared_experts.{gate,up,down}_proj``. The checkpoint's interleaved rotary rows (queries'
and k_pe's) are reordered before anything is built from them (``mla/rope.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagedkv.model.config import ModelConfig
from pagedkv.model.mla.rope import deinterleave_rope_rows

# An MLA layer's projections (ours -> the canonical pieces fused into it, by rows), with and
# without the queries' low rank; and its norms.
MLA_PROJECTIONS: dict[bool, dict[str, tuple[str, ...]]] = {
    False: {"mla.q_kv_a_proj": ("q_proj.weight", "kv_a_proj.weight")},
    True: {
        "mla.q_kv_a_proj": ("q_a_proj.weight", "kv_a_proj.weight"),
        "mla.q_b_proj": ("q_b_proj.weight",),
    },
}
MLA_NORMS: dict[bool, dict[str, str]] = {
    False: {"mla.kv_a_norm.weight": "kv_a_norm.weight"},
    True: {"mla.kv_a_norm.weight": "kv_a_norm.weight", "mla.q_a_norm.weight": "q_a_norm.weight"},
}
SHARED_EXPERTS: dict[str, tuple[str, ...]] = {
    "mlp.shared.gate_up_proj": ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"),
    "mlp.shared.down_proj": ("shared_experts.down_proj.weight",),
}
EXPERT_PIECES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def is_moe_layer(config: ModelConfig, index: int) -> bool:
    return config.moe is not None and config.moe.is_moe_layer(index)


def deepseek_projections(config: ModelConfig, index: int) -> dict[str, tuple[str, ...]]:
    """Layer ``index``'s DeepSeek projections (MLA's, the shared experts')."""
    table: dict[str, tuple[str, ...]] = {}
    if config.mla is not None:
        table.update(MLA_PROJECTIONS[config.mla.q_lora_rank is not None])
    if is_moe_layer(config, index) and config.moe is not None and config.moe.num_shared_experts:
        table.update(SHARED_EXPERTS)
    return table


def deepseek_norms(config: ModelConfig) -> dict[str, str]:
    return {} if config.mla is None else MLA_NORMS[config.mla.q_lora_rank is not None]


def deepseek_names(config: ModelConfig, index: int) -> list[str]:
    """Layer ``index``'s canonical DeepSeek tensors beyond the projections' and norms'."""
    names = ["kv_b_proj.weight"] if config.mla is not None else []
    moe = config.moe
    if moe is not None and moe.is_moe_layer(index):
        names.append("router.weight")
        names += ["router.bias"] if moe.topk_method == "noaux_tc" else []
        names += [f"experts.{e}.{p}" for e in range(moe.num_experts) for p in EXPERT_PIECES]
    return names


def rope_reordered(
    config: ModelConfig, index: int, weights: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """``weights`` with layer ``index``'s query and k_pe rows in the half-split rotary order
    where the checkpoint interleaves them (a new mapping; the others untouched)."""
    dims = config.mla
    if dims is None or not dims.rope_interleaved:
        return weights
    prefix, rope = f"layers.{index}.", dims.qk_rope_head_dim
    queries = "q_b_proj.weight" if dims.q_lora_rank is not None else "q_proj.weight"
    reordered = dict(weights)
    for name, width, offset in (
        (queries, dims.qk_head_dim, dims.qk_nope_head_dim),
        ("kv_a_proj.weight", dims.record_width, dims.kv_lora_rank),
    ):
        tensor = weights[prefix + name]
        if tensor.shape[0] % width:
            raise ValueError(f"{prefix}{name}: {tensor.shape[0]} rows, not heads of {width}")
        reordered[prefix + name] = deinterleave_rope_rows(tensor, width, offset, rope)
    return reordered


def load_deepseek(load, index: int, layer: nn.Module) -> None:
    """Layer ``index``'s MLA weights per head and its experts with their router (``load``:
    ``weights.Load``); the projections and norms came from the tables."""
    config, weights, dtype = load.config, load.weights, load.dtype
    prefix = f"layers.{index}."
    if (dims := config.mla) is not None:
        per_head = dims.qk_nope_head_dim + dims.v_head_dim
        kv_b = weights[prefix + "kv_b_proj.weight"]
        _check(prefix + "kv_b_proj.weight", kv_b, (dims.num_heads * per_head, dims.kv_lora_rank))
        layer.get_submodule("mla").load_kv_b(kv_b.to(dtype))
    if is_moe_layer(config, index):
        _load_experts(load, prefix, layer.get_submodule("mlp"))


def _load_experts(load, prefix: str, moe: nn.Module) -> None:
    """The router (+ its bias) and the routed experts, stacked, into ``moe`` (a ``MoE``)."""
    weights, shape = load.weights, load.config.moe
    num, hidden, width = shape.num_experts, load.config.hidden_size, shape.expert_intermediate_size
    router = weights[prefix + "router.weight"]
    _check(prefix + "router.weight", router, (num, hidden))
    bias = weights[prefix + "router.bias"] if shape.topk_method == "noaux_tc" else None
    if bias is not None:
        _check(prefix + "router.bias", bias, (num,))
    want = {"gate_proj.weight": (width, hidden), "up_proj.weight": (width, hidden)}
    want["down_proj.weight"] = (hidden, width)
    gate_up, down = [], []
    for e in range(num):
        names = {p: f"{prefix}experts.{e}.{p}" for p in EXPERT_PIECES}
        for piece, name in names.items():
            _check(name, weights[name], want[piece])
        pair = (weights[names["gate_proj.weight"]], weights[names["up_proj.weight"]])
        gate_up.append(torch.cat(pair))
        down.append(weights[names["down_proj.weight"]])
    stacked = (torch.stack(gate_up).to(load.dtype), torch.stack(down).to(load.dtype))
    moe.load_experts(router, bias, *stacked, load.kernels)


def _check(name: str, tensor: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(want):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, model wants {tuple(want)}")
