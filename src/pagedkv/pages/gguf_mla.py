"""The MLA and MoE facts of a GGUF ``deepseek2`` header (DeepSeek-V2, -V2-Lite, -V3 as
llama.cpp's converter writes them), as ``ModelShape`` fields. Pure Python.

llama.cpp's keys, after ``deepseek2.``: ``attention.kv_lora_rank`` / ``q_lora_rank``,
``rope.dimension_count`` (the rope dims), the query head's width as ``attention.key_length_mla``
and the value head's as ``attention.value_length_mla`` (converters before MLA absorption wrote
them as ``key_length`` / ``value_length``, which newer ones spend on the latent's widths);
``leading_dense_block_count``, ``expert_*`` for the experts (``expert_gating_func`` 1 =
softmax, 2 = sigmoid; ``expert_group_*`` the group limit), YaRN as ``rope.scaling.*`` with
``yarn_log_multiplier`` = 0.1 x mscale_all_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.pages.mla_shape import YarnRopeScaling
from pagedkv.pages.moe_shape import MoEShape

GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def gguf_mla_fields(metadata: dict[str, Any], arch: str, origin: str) -> dict[str, Any]:
    """An MLA model's fields beyond the header's common ones (none for a header without
    ``attention.kv_lora_rank``); ``UsageError`` naming the key a latent-attention model needs
    and the header lacks (a ``deepseek2`` header without the rank among them)."""
    if f"{arch}.attention.kv_lora_rank" not in metadata:
        if arch == "deepseek2":  # its attention is latent: its record needs the rank
            raise UsageError(f"GGUF {origin} lacks {arch}.attention.kv_lora_rank (MLA metadata)")
        return {}

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    def require(key: str) -> int:
        value = get(key)
        if value is None:
            raise UsageError(f"GGUF {origin} lacks {arch}.{key} (MLA metadata)")
        return int(value)

    rope = require("rope.dimension_count")
    mla_keys = get("attention.key_length_mla") is not None
    key_length = require("attention.key_length_mla" if mla_keys else "attention.key_length")
    value_length = require("attention.value_length_mla" if mla_keys else "attention.value_length")
    q_rank = get("attention.q_lora_rank")
    fields: dict[str, Any] = {
        "q_lora_rank": int(q_rank) if q_rank else None,
        "qk_nope_head_dim": key_length - rope,
        "v_head_dim": value_length,
        "head_dim": key_length,
        "rope_interleaved": True,  # llama.cpp rotates deepseek2's adjacent pairs, as stored
        "moe": _moe(get, require),
    }
    if metadata.get(f"{arch}.rope.scaling.type") == "yarn":
        log_multiplier = float(get("rope.scaling.yarn_log_multiplier") or 0.0)
        fields["yarn"] = YarnRopeScaling(
            factor=float(require("rope.scaling.factor")),
            original_max_position_embeddings=require("rope.scaling.original_context_length"),
            mscale=log_multiplier / 0.1,
            mscale_all_dim=log_multiplier / 0.1,
        )
    return fields


def _moe(get: Callable[[str], Any], require: Callable[[str], int]) -> MoEShape | None:
    if not get("expert_count"):
        return None
    gating = int(get("expert_gating_func") or 1)
    if gating not in GATING_FUNCS:
        raise UsageError(f"unknown expert_gating_func {gating} (known: 1 softmax, 2 sigmoid)")
    scoring = GATING_FUNCS[gating]
    groups = int(get("expert_group_count") or 1)
    method = "noaux_tc" if scoring == "sigmoid" else "group_limited_greedy"
    return MoEShape(
        num_experts=require("expert_count"),
        num_experts_per_tok=require("expert_used_count"),
        expert_intermediate_size=require("expert_feed_forward_length"),
        num_shared_experts=int(get("expert_shared_count") or 0),
        first_dense_layers=int(get("leading_dense_block_count") or 0),
        num_groups=groups,
        topk_groups=int(get("expert_group_used_count") or groups),
        scoring=scoring,
        topk_method=method if groups > 1 or scoring == "sigmoid" else "greedy",
        norm_topk_prob=bool(get("expert_weights_norm") or False),
        routed_scaling_factor=float(get("expert_weights_scale") or 1.0),
    )
