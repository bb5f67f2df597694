"""SwiGLU's activation in one launch: ``silu(gate) * up`` of the gate/up projection's output.

``[T, 2I] -> [T, I]``: the gate is the first half of each row and ``up`` the second (as
``layers.SwiGLU`` takes them: ``column_halves`` of the fused product), where the torch path
is ``F.silu(gate).mul_(up)``: two kernels and a ``[T, I]`` intermediate each layer.

Grid: one program per (row, ``BLOCK`` columns of the output).

The arithmetic is torch's, in fp32 whatever the dtype: ``silu(g) = g / (1 + exp(-g))``
(torch's CPU and CUDA formula; the division IEEE-rounded, ``div_rn``: a compiled Triton ``/``
is approximate), rounded to the dtype, then ``* up`` rounded to the dtype: in bf16, the two
roundings of torch's two ops (vLLM's kernel skips the first; the point here is tokens equal to
the torch path). What cannot match is ``exp``: torch's CPU uses SLEEF's (1 ulp), numpy (the
interpreter) its own, a compiled Triton kernel ``ex2.approx`` of ``g * log2(e)`` (a few ulps,
growing with ``|g|``); so fp32 outputs are within a few ulps of torch's, not bit-equal, and bf16
ones equal except where that last-bit difference crosses a bf16 rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # output columns a program (a 14,336-wide Llama-3-8B row: 14 programs)


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=live, other=0.0).to(tl.float32)
    act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds silu's output
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=live)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` [T, 2I] (fp32 or bf16; rows
    may be strided, columns contiguous). Returns ``out`` [T, I] in ``gate_up``'s dtype: a new
    tensor, or ``out`` (same dtype, columns contiguous) written over. Mutates nothing else;
    reads only shapes and strides on the host (no sync: usable inside CUDA-graph capture)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)}: want [T, 2I]")
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.stride(1) != 1:
        raise ValueError("gate_up must be float32 or bfloat16 with contiguous columns")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (num_tokens, inter) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: want [{num_tokens}, {inter}]")
    if num_tokens > 0 and inter > 0:
        block = min(BLOCK, triton.next_power_of_2(inter))
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block)
    return out
