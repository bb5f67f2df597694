"""DeepSeek's rotary embedding: YaRN frequencies (with the cos/sin scale) over the
``qk_rope_head_dim`` rotary dims, and the checkpoint's interleaved rotary rows reordered once at
load so that the half-split rotation of ``layers.apply_rotary`` applies."""

from __future__ import annotations

import math

import torch

from pagedkv.model.layers import RotaryEmbedding
from pagedkv.pages.mla_shape import MLADims, YarnRopeScaling


def yarn_inverse_frequencies(dim: int, theta: float, yarn: YarnRopeScaling) -> torch.Tensor:
    """fp32 ``[dim // 2]``: transformers' ``_compute_yarn_parameters`` (frequencies turning
    fewer than ``beta_slow`` times over the original context interpolated by ``factor``, more
    than ``beta_fast`` kept, a linear ramp between)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        original = yarn.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


def mla_rotary(dims: MLADims, theta: float, yarn: YarnRopeScaling | None) -> RotaryEmbedding:
    """The rotary embedding of the ``qk_rope_head_dim`` rotary dims: plain, or YaRN's
    frequencies with cos and sin scaled by its attention factor."""
    rotary = RotaryEmbedding(dims.qk_rope_head_dim, theta, None)
    if yarn is not None:
        rotary.inv_freq = yarn_inverse_frequencies(dims.qk_rope_head_dim, theta, yarn)
        rotary.cos_sin_scale = yarn.cos_sin_scale()
    return rotary


def deinterleave_rope_rows(weight: torch.Tensor, width: int, offset: int, rope_dim: int):
    """``weight`` (rows ``[groups * width, ...]``, or a bias) with rows ``[offset, offset +
    rope_dim)`` of each group of ``width`` reordered from DeepSeek's adjacent pairs (0, 1),
    (2, 3) ... to halves (0, 2, 4 ..., 1, 3, 5 ...): rotating pairs (i, i + rope_dim / 2)
    then gives the checkpoint's rotation of pairs (2i, 2i + 1). Queries and keys reordered
    alike keep every score; the cached k_pe is in the reordered layout. A new tensor."""
    rows = weight.shape[0]
    grouped = weight.reshape(rows // width, width, *weight.shape[1:]).clone()
    part = grouped[:, offset : offset + rope_dim]
    grouped[:, offset : offset + rope_dim] = torch.cat((part[:, 0::2], part[:, 1::2]), dim=1)
    return grouped.reshape(weight.shape)
