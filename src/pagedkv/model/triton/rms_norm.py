"""RMSNorm, alone or fused with the residual add before it, in one launch.

``rms_norm(x, weight, eps, residual)`` is vLLM's ``fused_add_rms_norm``: the new residual
``x + residual`` and ``rmsnorm(x + residual) * weight``, where the torch path is an add and the
six to eight ops of ``layers.RMSNorm`` (61 norms and 60 adds per decode step of a 30-layer
model: launch-bound at small batches).

Grid: one program per row (token); the whole hidden row is one tile (hidden <= ``MAX_HIDDEN``).

The arithmetic is ``layers.RMSNorm``'s, op for op, in fp32 whatever the dtype:
``y = (x * rsqrt(mean(x * x) + eps)).to(dtype) * weight``, the residual add rounded to the
dtype first (torch adds two bf16 tensors in fp32 and rounds), ``rsqrt`` as ``1 / sqrt`` and
the mean as ``sum / hidden``, both IEEE-rounded (``div_rn``, ``sqrt_rn``: a compiled Triton
``/`` is approximate), the products separate (torch does not contract them). What cannot match
is the order of the sum of squares (torch's vectorised cascade vs Triton's tree): the mean
may differ in its last bits, so fp32 outputs are within a few ulps of torch's, not bit-equal;
the residual is bit-equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 65536  # one row is one tile: 256 KiB of fp32 registers and spills beyond


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    hidden_f,  # float(hidden): the mean's divisor
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    if HAS_RESIDUAL:  # the new residual, rounded to the dtype as torch's add rounds it
        r = tl.load(residual_ptr + row * stride_r + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=live)
    x32 = x.to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(x32 * x32, 0), hidden_f)
    inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    normed = (x32 * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=live)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    in_place: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``layers.RMSNorm`` of ``x`` [T, H], or of ``x + residual`` when ``residual`` is given.

    ``x`` and ``residual`` [T, H] (rows may be strided, columns contiguous) and ``weight`` [H]
    share one dtype (fp32 or bf16; the model casts its norms' weights to its dtype).
    Returns ``out`` [T, H] in that dtype, or ``(out, new_residual)`` with
    ``new_residual = x + residual``. New tensors, unless ``in_place``: then ``out`` is written
    into ``x`` and ``new_residual`` into ``residual`` (vLLM's in-place contract; each program
    reads its whole row before writing it) and those are returned. Mutates nothing else;
    reads only shapes and strides on the host (no sync: usable inside CUDA-graph capture).
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: want [T, H] / [H]")
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    if any(t.dtype != x.dtype for t in tensors) or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("x, weight and residual must share one dtype, float32 or bfloat16")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the hidden dim of x, weight and residual must be contiguous")
    num_tokens, hidden = x.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is over {MAX_HIDDEN} (one row is one tile)")
    out = x if in_place else torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = residual
    if residual is not None and not in_place:
        res_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            x,
            x if residual is None else residual,  # unread without a residual
            weight,
            out,
            out if res_out is None else res_out,  # unwritten without a residual
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            out.stride(0) if res_out is None else res_out.stride(0),
            hidden,
            float(hidden),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out if res_out is None else (out, res_out)


def _num_warps(block: int) -> int:
    """4 warps up to 2,048 columns, then 8 and 16: ~16 fp32 values a thread stay in registers."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
