"""What the fused-kernel tests share: distances in ulps, and the interpreter's bf16 rounding
made the GPU's."""

from __future__ import annotations

import os

import numpy as np
import torch

_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF)}


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between two tensors of one dtype (fp32 or bf16) in units in the
    last place: how many representable values lie between them (0: the same bits, or +0/-0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    int_dtype, magnitude = _BITS[got.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:  # the floats' order as int64s
        bits = t.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(bits < 0, -(bits & magnitude), bits)

    return (ordered(got) - ordered(want)).abs()


def round_bf16_to_nearest_even(monkeypatch) -> None:
    """Triton 3.9's interpreter casts fp32 to bf16 by truncating the mantissa; a GPU (LLVM's
    fptrunc) and torch round to nearest even. Make the interpreter round like the GPU, through
    torch, so stored bits compare exactly (as ``test_kv_write.py`` does); a compiled kernel
    never meets this. No effect outside the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        bits = rounded.view(torch.int16).numpy().view(np.uint16)  # the interpreter's bf16
        return interpreter.TensorHandle(bits, tl.bfloat16)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
