"""The mixture-of-experts MLP of DeepSeek-V2/V3 (``pages/moe_shape.py`` says how it routes): the
MLP part of an MoE layer, in place of SwiGLU (``decoder_layer.py`` chooses by the shape).

``MoE(x)`` is ``routed(x) + shared(x)``:

- ``route``: the router's fp32 logits -> scores (softmax or sigmoid) -> each token's
  ``num_experts_per_tok`` experts (greedy, group-limited, or V3's biased group choice) and their
  weights (normalised when asked, times ``routed_scaling_factor``), all tokens at once;
- ``routed``: the (token, expert) pairs sorted by expert, so each expert's tokens are one run
  of rows, and each expert's SwiGLU one product over its run (``F.grouped_mm`` with the runs'
  offsets, which stay on the device: no host sync, no loop over tokens or experts), weighted,
  then summed back per token in expert order (the reference's order);
- ``shared``: the shared experts, one SwiGLU of ``num_shared_experts`` experts' width.

The router's weight and bias stay fp32 whatever the model dtype (as the references keep them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.model.config import ModelConfig
from pagedkv.model.layers import SwiGLU
from pagedkv.pages.moe_shape import MoEShape

ROUTING_EPS = 1e-20  # the references' guard on the normalised weights' sum


class MoE(nn.Module):
    """Routed experts ``[E, 2I, H]`` (gate rows then up rows) and ``[E, H, I]``, the router
    ``[E, H]`` (+ its score bias ``[E]`` for ``noaux_tc``) and the shared experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        shape = config.moe
        assert shape is not None  # built for a layer the shape routes (decoder_layer)
        self.shape = shape
        hidden, width, num = config.hidden_size, shape.expert_intermediate_size, shape.num_experts
        self.router_weight = nn.Parameter(torch.empty(num, hidden), requires_grad=False)
        self.router_bias: nn.Parameter | None = None
        if shape.topk_method == "noaux_tc":
            self.router_bias = nn.Parameter(torch.empty(num), requires_grad=False)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num, 2 * width, hidden), requires_grad=False
        )
        self.experts_down = nn.Parameter(torch.empty(num, hidden, width), requires_grad=False)
        self.shared: SwiGLU | None = None
        if shape.num_shared_experts:
            self.shared = SwiGLU(hidden, width * shape.num_shared_experts)

    def load_experts(
        self,
        router: torch.Tensor,
        bias: torch.Tensor | None,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        kernels=None,
    ) -> None:
        """Take the router ``[E, H]`` (kept fp32), its score bias ``[E]`` (``noaux_tc``), the
        stacked experts (``[E, 2I, H]``, ``[E, H, I]``, in the model dtype); ``kernels``: the
        shared experts' native SiLU * up (``layers.SwiGLU``). Shapes checked by the loader."""
        self.router_weight = nn.Parameter(router.float().contiguous(), requires_grad=False)
        if self.router_bias is not None and bias is not None:
            self.router_bias = nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self.experts_gate_up = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.experts_down = nn.Parameter(down.contiguous(), requires_grad=False)
        if self.shared is not None:
            self.shared.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: the MLP's output for ``x`` ``[T, H]`` (the residual is the layer's), a
        new tensor."""
        weights, experts = route(x, self.router_weight, self.router_bias, self.shape)
        out = routed(x, weights, experts, self.experts_gate_up, self.experts_down)
        if self.shared is not None:
            out += self.shared(x)
        return out


def route(
    x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, shape: MoEShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weights ``[T, k]`` and expert ids (int64 ``[T, k]``) of every token of ``x``."""
    logits = F.linear(x.float(), router.float())
    scores = logits.softmax(-1) if shape.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if shape.grouped:
        num_tokens, groups = x.shape[0], shape.num_groups
        by_group = choice.view(num_tokens, groups, -1)
        if shape.topk_method == "noaux_tc":  # V3: a group's two best biased scores
            group_scores = by_group.topk(2, dim=-1).values.sum(-1)
        else:  # V2: a group's best score
            group_scores = by_group.amax(-1)
        kept = group_scores.topk(shape.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        dropped = -torch.inf if shape.topk_method == "noaux_tc" else 0.0
        choice = by_group.masked_fill(~keep[:, :, None], dropped).view(num_tokens, -1)
    experts = choice.topk(shape.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if shape.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + ROUTING_EPS)
    return weights * shape.routed_scaling_factor, experts


def routed(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` ``[T, H]``, each expert one
    product over the run of its tokens."""
    num_tokens, k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs, by expert then token
    tokens = order // k
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)  # each expert's run ends here
    rows = x.index_select(0, tokens)
    hidden = _grouped(rows, gate_up, ends, counts)
    gate, up = hidden.chunk(2, dim=-1)
    out = _grouped(F.silu(gate) * up, down, ends, counts)
    out = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, out)


def _grouped(
    rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Rows ``[ends[e-1], ends[e])`` times ``weight[e]^T`` (``[E, out, in]``), for every e."""
    if rows.device.type == "cpu" or rows.dtype == torch.bfloat16:
        return F.grouped_mm(rows, weight.transpose(1, 2), offs=ends)
    # torch's grouped GEMM on a GPU takes bf16 only: other dtypes, a product per expert with
    # tokens, the runs' lengths read once on the host.
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(counts.cpu().tolist()):  # a host sync: fp32 MoE on a GPU
        if count:
            out[start : start + count] = rows[start : start + count] @ weight[expert].t()
        start += count
    return out
