"""A mixture-of-experts MLP's shape facts (DeepSeek-V2/V3): routed experts, their routing and
the shared experts. Pure Python, no torch: ``pages/sources.py`` reads them from a
``config.json`` or a GGUF header, ``model/moe.py`` routes with them, a planner may count the
weights a step reads.

Routing, as DeepSeek's own code and transformers' do it (``model/moe.py``): ``scoring`` turns
the router's logits into scores (``softmax``: V2; ``sigmoid``: V3); ``topk_method`` picks
``num_experts_per_tok`` experts per token: ``greedy`` the top scores, ``group_limited_greedy``
(V2) the top scores among the ``topk_groups`` groups (of ``num_groups``) with the highest
maximum, ``noaux_tc`` (V3) the top scores plus a learned per-expert bias among the groups with
the highest sum of their two best biased scores (the weights stay the unbiased scores); the
weights are normalised to sum 1 when ``norm_topk_prob``, then multiplied by
``routed_scaling_factor``. The first ``first_dense_layers`` layers (and those off
``layer_freq``) keep a dense MLP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import UsageError

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# What a config.json that does not say means, per family (its reference code's choice).
FAMILY_ROUTING = {"deepseek_v2": ("softmax", "greedy"), "deepseek_v3": ("sigmoid", "noaux_tc")}


@dataclass(frozen=True)
class MoEShape:
    """One MoE family's experts and routing; validated on construction (``UsageError`` naming
    the config.json key)."""

    num_experts: int  # n_routed_experts
    num_experts_per_tok: int
    expert_intermediate_size: int  # moe_intermediate_size
    num_shared_experts: int  # n_shared_experts (0: none)
    first_dense_layers: int = 0  # first_k_dense_replace
    layer_freq: int = 1  # moe_layer_freq
    num_groups: int = 1  # n_group
    topk_groups: int = 1  # topk_group
    scoring: str = "softmax"  # scoring_func
    topk_method: str = "greedy"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for key, value, lowest in (
            ("n_routed_experts", self.num_experts, 1),
            ("num_experts_per_tok", self.num_experts_per_tok, 1),
            ("moe_intermediate_size", self.expert_intermediate_size, 1),
            ("n_shared_experts", self.num_shared_experts, 0),
            ("first_k_dense_replace", self.first_dense_layers, 0),
            ("moe_layer_freq", self.layer_freq, 1),
            ("n_group", self.num_groups, 1),
            ("topk_group", self.topk_groups, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise UsageError(f"{key} must be an integer >= {lowest}, got {value!r}")
        if self.scoring not in SCORING_FUNCS:
            raise UsageError(
                f"scoring_func must be one of {', '.join(SCORING_FUNCS)}, got {self.scoring!r}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise UsageError(
                f"topk_method must be one of {', '.join(TOPK_METHODS)}, got {self.topk_method!r}"
            )
        self._check_groups()
        if not self.routed_scaling_factor > 0:
            raise UsageError(
                f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}"
            )

    def _check_groups(self) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise UsageError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                f"({self.num_experts})"
            )
        if not self.grouped:
            return
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise UsageError(
                f"n_group ({self.num_groups}) must divide n_routed_experts ({self.num_experts}) "
                f"and be >= topk_group ({self.topk_groups})"
            )
        per_group = self.num_experts // self.num_groups
        if self.topk_groups * per_group < self.num_experts_per_tok or (
            self.topk_method == "noaux_tc" and per_group < 2
        ):
            raise UsageError(
                f"topk_group ({self.topk_groups}) groups of {per_group} experts cannot hold "
                f"num_experts_per_tok ({self.num_experts_per_tok}) picks"
            )

    @property
    def grouped(self) -> bool:
        """Whether routing first limits each token to ``topk_groups`` groups."""
        return self.topk_method != "greedy" and self.num_groups > 1

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (from 0) has the experts (else a dense MLP)."""
        return index >= self.first_dense_layers and index % self.layer_freq == 0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], family: str | None) -> MoEShape | None:
        """The MoE of a config.json dict (None: it has no routed experts); routing the
        ``family``'s (``FAMILY_ROUTING``) where the file does not say."""
        if not config.get("n_routed_experts"):
            return None
        scoring, method = FAMILY_ROUTING.get(family or "", ("softmax", "greedy"))

        def get(key: str, default: Any) -> Any:
            value = config.get(key)
            return default if value is None else value

        return cls(
            num_experts=get("n_routed_experts", 0),
            num_experts_per_tok=get("num_experts_per_tok", 0),
            expert_intermediate_size=get("moe_intermediate_size", 0),
            num_shared_experts=get("n_shared_experts", 0),
            first_dense_layers=get("first_k_dense_replace", 0),
            layer_freq=get("moe_layer_freq", 1),
            num_groups=get("n_group", 1),
            topk_groups=get("topk_group", 1),
            scoring=get("scoring_func", scoring),
            topk_method=get("topk_method", method),
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        )
