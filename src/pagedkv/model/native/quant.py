"""``NativeQuantProjection``: weights kept in GGUF's Q4_1 or Q8_0 blocks, multiplied by
pagedkv's kernels (``native_chain.c``, ``native_gemm.c``) with fp32 activations.

Up to 8 rows each thread decodes 16 weight rows (8 on AVX2) at a time into its scratch and
runs the fp32 kernel's own code on them (``native_chain.c``), so a product reads 0.625 (Q4_1)
or 1.06 (Q8_0) bytes a weight instead of 4. From 9 rows (``pk_gemm_blocks`` above 64) the
GEMM decodes the weight rows of each tile into a thread's scratch, once per span of a few
hundred rows of x. Either way the bits are the fp32 kernels' on the dequantized matrix, which
is never written (``native_projection.dense_*``; MKL, where the GEMM is switched off, gets the
matrix dequantized whole).

The encoders below are GGUF's formats exactly: a group of 32 weights keeps d (and m) as fp16.
Re-encoding weights that were decoded from such blocks gives back the same bytes (tested on
llama.cpp-made blocks), so on the embedded model, whose file is Q4_1 with a Q8_0 embedding,
``--weights int4`` multiplies exactly the fp32 weights: its logits are the fp32 path's, bit
for bit, at a sixth of the bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.model import native
from pagedkv.model.gguf_quants import BLOCK_WEIGHTS
from pagedkv.model.native.projection import (
    BlockWeight,
    dense_added_to,
    dense_halves,
    dense_path,
    dense_product,
    fits_kernel,
    takes_residual,
)
from pagedkv.model.projection import ProjectionBase

GROUP = BLOCK_WEIGHTS
FORMATS = {"q4_1": 4, "q8_0": 8}  # the kernels' format codes (PK_Q4_1, PK_Q8_0 in C)


def encode_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks of fp32 ``[n, k]`` (k % 32 == 0): uint8 ``[n, k / 32 * 20]``.

    Per group: m = the minimum, d = (max - min) / 15, both rounded to fp16, q = round((w - m)
    / d) clamped to 0..15 (0 where d is 0); byte j holds q[j] | q[j + 16] << 4."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d16, m16 = ((high - low) / 15).half(), low.half()
    d, m = d16.float()[..., None], m16.float()[..., None]
    q = torch.where(d > 0, torch.round((groups - m) / d.clamp_min(1e-30)), 0).clamp_(0, 15)
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    parts = (d16[..., None].view(torch.uint8), m16[..., None].view(torch.uint8), nibbles)
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def encode_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 blocks of fp32 ``[n, k]`` (k % 32 == 0): uint8 ``[n, k / 32 * 34]``.

    Per group: d = max |w| / 127 rounded to fp16, q = round(w / d) clamped to -127..127."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    d16 = (groups.abs().amax(-1) / 127).half()
    d = d16.float()[..., None]
    q = torch.where(d > 0, torch.round(groups / d.clamp_min(1e-30)), 0).clamp_(-127, 127)
    parts = (d16[..., None].view(torch.uint8), q.to(torch.int8).view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


ENCODERS = {"q4_1": encode_q4_1, "q8_0": encode_q8_0}


class NativeQuantProjection(ProjectionBase):
    """``x @ W.T (+ bias)``, W fp32 ``[out, in]`` given once and kept as ``fmt`` blocks
    ("q4_1" or "q8_0"); ``in`` a multiple of 32. Output fp32."""

    def __init__(self, fmt: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"native quantized formats are {sorted(FORMATS)}, not {fmt!r}")
        out_features, in_features = weight.shape
        if in_features % GROUP:
            raise ValueError(f"{fmt} needs in_features % {GROUP} == 0, got {in_features}")
        self._lib = native.kernels()
        if self._lib is None:
            raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("blocks", ENCODERS[fmt](weight))
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.to(torch.float32).contiguous(), requires_grad=False)
        )
        self._kernel = getattr(self._lib, f"pk_linear_{fmt}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fits_kernel(x, self.in_features):
            return self._run(x, None)
        return dense_product(x, self._block_weight(), self.bias)

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if fits_kernel(x, self.in_features) and takes_residual(residual, x, self.out_features):
            return self._run(x, residual)
        return dense_added_to(residual, x, self._block_weight(), self.bias)

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not fits_kernel(x, self.in_features):
            return dense_halves(x, self._block_weight(), self.bias)
        return super().halves(x)

    def dense_weight(self) -> torch.Tensor:
        """The weight dequantized, fp32 ``[out, in]`` (a new tensor the caller may keep)."""
        weight = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self._lib.pk_dequantize(
            FORMATS[self.fmt],
            self.blocks.data_ptr(),
            weight.data_ptr(),
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        return weight

    def _block_weight(self) -> BlockWeight:
        shape = (self.out_features, self.in_features)
        return BlockWeight(FORMATS[self.fmt], self.blocks, shape, self.dense_weight)

    def kernel_operand(self) -> tuple[int, int]:
        """``(format, address)`` of the blocks for ``pk_decode_layer`` (4: Q4_1, 8: Q8_0)."""
        return FORMATS[self.fmt], self.blocks.data_ptr()

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = self._kernel(
            x.data_ptr(),
            self.blocks.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            y.data_ptr(),
            rows,
            self.in_features,
            self.out_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"{self.fmt} projection: no memory for a thread's scratch")
        return y

    def describe(self) -> str:
        above = (
            "pagedkv's GEMM decoding the blocks tile by tile"
            if native.gemm_kernels() is not None
            else f"dequantized, then {dense_path()}"
        )
        return (
            f"{self.fmt} blocks on pagedkv's {native.isa().upper()} kernel, fp32 activations, "
            f"up to {native.MAX_ROWS} rows; above, {above}"
        )

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()
