"""The position-wise building blocks: RMSNorm, rotary embeddings (plain and llama3), SwiGLU.
The projections live in ``projection.py``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.model.projection import Projection
from pagedkv.pages.shape import Llama3RopeScaling


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 whatever the model dtype (as the references do)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        # The compiled kernels (``native.py``), set by the model's loader in fp32: one call
        # where torch's composite rms_norm makes ~20 dispatches (61 norms a decode step).
        self.kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if (
            self.kernels is not None
            and dtype == torch.float32
            and x.dim() == 2
            and x.is_contiguous()
            and not torch.compiler.is_compiling()
        ):
            y = torch.empty_like(x)
            rows, hidden = x.shape
            self.kernels.pk_rms_norm(
                x.data_ptr(),
                self.weight.data_ptr(),
                y.data_ptr(),
                rows,
                hidden,
                self.eps,
                torch.get_num_threads(),
            )
            return y
        if dtype == torch.float32:  # one call instead of six (61 norms per step); torch's
            # own entry, not F.rms_norm, whose Python wrapper costs ~10 us a call at batch 1
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None
) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` angular frequencies, with the llama3 rescaling when asked."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # llama3: wavelengths longer than the original context / low_freq_factor are slowed by
    # `factor`; shorter than context / high_freq_factor stay; in between, a linear blend.
    old_ctx = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = inv_freq / scaling.factor
    blend = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * slowed + blend * inv_freq
    out = torch.where(wavelen > old_ctx / scaling.low_freq_factor, slowed, inv_freq)
    medium = (wavelen >= old_ctx / scaling.high_freq_factor) & (
        wavelen <= old_ctx / scaling.low_freq_factor
    )
    return torch.where(medium, blended, out)


class RotaryEmbedding(nn.Module):
    """Half-split ("NeoX") rotary embedding, the layout of Hugging Face Llama/Qwen2 weights.

    GGUF Llama weights are stored for llama.cpp's adjacent-pair rotation; the GGUF loader
    un-permutes their Q/K rows so this one rotation serves every source.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cos_sin_scale = 1.0  # YaRN's attention factor (``mla/rope.py``) multiplies both

    def scale_frequencies(self, factors: torch.Tensor) -> None:
        """Divide the frequencies by per-frequency ``factors`` (GGUF ``rope_freqs.weight``)."""
        if factors.shape != self.inv_freq.shape:
            raise ValueError(
                f"rope_freqs has shape {tuple(factors.shape)}, want {tuple(self.inv_freq.shape)}"
            )
        self.inv_freq = self.inv_freq / factors.to(torch.float32)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` of shape ``[T, 1, head_dim]`` (broadcast over heads), in
        ``dtype``, as ``apply_rotary`` takes them: ``[cos, cos]`` and ``[-sin, sin]``.

        Angles are formed in fp32: at position 8k a bf16 angle would be off by whole radians.
        """
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.cos_sin_scale != 1.0:
            cos, sin = cos * self.cos_sin_scale, sin * self.cos_sin_scale
        return (
            torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
            torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :],
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``; pairs are (i, i + head_dim/2). Returns a new tensor.

    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` as ``x * cos + (x2, x1) * (-sin, sin)``:
    three ops instead of seven (each small op costs ~5 us between the matmuls of a decode
    step; 30 layers).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def rotated_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q ``[T, Hq, D]``, K and V ``[T, Hkv, D]`` of a fused QKV product, RoPE applied by torch
    ops (Q and K new tensors, V a view). ``heads``: (query heads, KV heads, head dim)."""
    num_heads, num_kv_heads, head_dim = heads
    num_tokens, qk_size = qkv.shape[0], (num_heads + num_kv_heads) * head_dim
    # Slices, not Tensor.split: its Python wrapper costs ~15 us a call at batch 1.
    qk, v = qkv[:, :qk_size], qkv[:, qk_size:]
    # Q and K heads rotated in one pass (half the elementwise ops of two calls).
    qk = apply_rotary(qk.view(num_tokens, num_heads + num_kv_heads, head_dim), cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:], v.view(num_tokens, num_kv_heads, head_dim)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Projection(hidden_size, 2 * intermediate_size)
        self.down_proj = Projection(intermediate_size, hidden_size)
        self.kernels = None  # native.kernels(), set by the loader in fp32: silu * up in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x))

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """The gate/up product ``[T, 2I]`` (for a kernel that splits it itself)."""
        return self.gate_up_proj(x)

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate(x)) * up(x)`` ``[T, I]``: the halves of the gate/up product as the
        projection hands them (shards of one product without a copy), then one C call."""
        gate, up = self.gate_up_proj.halves(x)
        if (
            self.kernels is not None
            and gate.dtype == torch.float32
            and gate.stride(1) == 1
            and up.stride(1) == 1
            and not torch.compiler.is_compiling()
        ):  # rows of each half evenly strided: halves of one product, or two shards
            rows, half = gate.shape
            out = torch.empty(rows, half, dtype=torch.float32)
            self.kernels.pk_silu_mul(
                gate.data_ptr(),
                gate.stride(0),
                up.data_ptr(),
                up.stride(0),
                out.data_ptr(),
                rows,
                half,
                torch.get_num_threads(),
            )
            return out
        return F.silu(gate).mul_(up)
