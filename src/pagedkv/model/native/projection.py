"""``NativeProjection``: an fp32 projection that runs small batches on pagedkv's own kernel.

Up to ``native.MAX_ROWS`` rows (every decode step of up to 64 sequences, short prompts) the
product is ``native.pk_linear``: up to 8 rows ``native_chain.c`` (16 output columns a vector,
the weights streamed once at the memory's bandwidth), from 9 rows pagedkv's GEMM. Above 64
rows (prompts) the product is ``native.pk_gemm`` (``native_gemm.c``). Every one of them
computes an output element as one fused multiply-add chain in k order, then + bias, then
residual +, so a sequence gets bit-identical logits alone and in any batch, in a decode step
and in a mixed one, on AVX2 and AVX-512. Where the GEMM is switched off
(``native.set_gemm``) or the shapes do not fit, more than 64 rows go to MKL's GEMM as one
``bmm`` over a shard of output rows per torch thread (views of the weight), its consumers
reading the shards where they lie (``layers.shard_*``); those bits are MKL's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from pagedkv.model import native
from pagedkv.model.projection import (
    ProjectionBase,
    column_halves,
    joined,
    projection_from_pieces,
    shard_count,
    shard_halves,
    shards_added_to,
)


class NativeProjection(ProjectionBase):
    """``x @ weight.T (+ bias)`` with ``weight`` ``[out, in]`` fp32 (nn.Linear's layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if weight.dtype != torch.float32 or in_features % 8:
            raise ValueError(
                f"NativeProjection needs fp32 [out, in] with in % 8 == 0, got {weight.dtype} "
                f"{tuple(weight.shape)}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.to(torch.float32).contiguous(), requires_grad=False)
        )
        self._lib = native.kernels()
        if self._lib is None:
            raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fits_kernel(x, self.in_features):
            return self._run(x, None)
        return dense_product(x, self.weight, self.bias)

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if fits_kernel(x, self.in_features) and takes_residual(residual, x, self.out_features):
            return self._run(x, residual)
        return dense_added_to(residual, x, self.weight, self.bias)

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not fits_kernel(x, self.in_features):
            return dense_halves(x, self.weight, self.bias)
        return super().halves(x)

    def dense_weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (itself)."""
        return self.weight

    def tied_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``input_ids`` of the weight, ``[T, in]``: the embedding of a tied lm_head."""
        return self.weight.index_select(0, input_ids)

    def kernel_operand(self) -> tuple[int, int]:
        """``(format, address)`` of the weight for ``pk_decode_layer`` (0: fp32 rows)."""
        return 0, self.weight.data_ptr()

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        status = self._lib.pk_linear(
            x.data_ptr(),
            self.weight.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            y.data_ptr(),
            rows,
            self.in_features,
            self.out_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("pk_linear: no memory for a thread's panel")
        return y

    def describe(self) -> str:
        return (
            f"float32 matmuls: pagedkv's {native.isa().upper()} kernel up to {native.MAX_ROWS} rows "
            f"(one FMA chain an output), above {dense_path()}"
        )


def dense_path() -> str:
    """What multiplies more than ``native.MAX_ROWS`` rows in this process, for the reports."""
    if native.gemm_kernels() is not None:
        return "pagedkv's GEMM (one FMA chain an output, batch-invariant)"
    return "MKL, one bmm over a row shard of the weight per torch thread"


def kernel_reads(x: torch.Tensor, in_features: int) -> bool:
    """Whether a native kernel can read ``x`` as its input: 2-D contiguous fp32 ``[rows, in]``,
    outside torch.compile (whatever the number of rows)."""
    return (
        x.dim() == 2
        and x.shape[1] == in_features
        and x.dtype == torch.float32
        and x.is_contiguous()
        and not torch.compiler.is_compiling()
    )


def fits_kernel(x: torch.Tensor, in_features: int) -> bool:
    """Whether ``x`` goes to a native projection kernel: one it reads, at most
    ``native.MAX_ROWS`` rows (above, a compute-bound GEMM is faster)."""
    return x.shape[0] <= native.MAX_ROWS and kernel_reads(x, in_features)


def takes_residual(residual: torch.Tensor, x: torch.Tensor, out_features: int) -> bool:
    """Whether a kernel can add ``residual`` in its epilogue (contiguous fp32 ``[rows, out]``)."""
    return (
        residual.dtype == torch.float32
        and residual.is_contiguous()
        and residual.shape == (x.shape[0], out_features)
    )


def sharded_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` as ``[threads, rows, out / threads]`` (one ``bmm`` over views
    of the weight's row shards), or None where one ``mm`` is the path: one thread, rows that do
    not split evenly, torch.compile. Not bit-identical to ``mm``."""
    threads = shard_count()
    out_features, in_features = weight.shape
    if threads == 1 or out_features % threads or torch.compiler.is_compiling():
        return None
    rows, width = x.shape[0], out_features // threads
    shards = weight.view(threads, width, in_features).transpose(1, 2)
    inputs = x.expand(threads, rows, in_features)
    if bias is None:
        return torch.bmm(inputs, shards)
    return torch.baddbmm(bias.view(threads, 1, width), inputs, shards)


class BlockWeight(NamedTuple):
    """A weight ``[out, in]`` kept in GGUF blocks: ``kind`` (4: Q4_1, 8: Q8_0, the kernels'
    codes), the uint8 ``blocks``, and ``dense``, which gives the matrix dequantized to fp32 for
    the paths that read one (MKL)."""

    kind: int
    blocks: torch.Tensor
    shape: tuple[int, int]
    dense: Callable[[], torch.Tensor]


Weight = torch.Tensor | BlockWeight


def gemm_product(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``(residual +) x @ weight.T (+ bias)`` on ``native.pk_gemm`` (``pk_gemm_blocks`` for a
    ``BlockWeight``: the same bits as on its dequantized matrix, decoded tile by tile), or None
    where it is not the path: switched off or unavailable, ``x`` not 2-D contiguous fp32 with
    ``in % 8 == 0``, a weight that is not contiguous fp32 ``[out, in]``, a residual the
    epilogue cannot take, torch.compile."""
    lib = native.gemm_kernels()
    out_features, in_features = weight.shape
    blocks = isinstance(weight, BlockWeight)
    if (
        lib is None
        or not kernel_reads(x, in_features)
        or in_features % 8
        or (not blocks and (weight.dtype != torch.float32 or not weight.is_contiguous()))
        or (bias is not None and not bias.is_contiguous())
        or (residual is not None and not takes_residual(residual, x, out_features))
    ):
        return None
    rows = x.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32)
    operands = (
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        y.data_ptr(),
        rows,
        in_features,
        out_features,
        torch.get_num_threads(),
    )
    if blocks:
        status = lib.pk_gemm_blocks(weight.kind, x.data_ptr(), weight.blocks.data_ptr(), *operands)
    else:
        status = lib.pk_gemm(x.data_ptr(), weight.data_ptr(), *operands)
    if status == -1:
        raise MemoryError("pk_gemm: no memory for a thread's panel")
    if status != 0:
        raise ValueError(f"pk_gemm_blocks: no weight format {weight.kind}")
    return y


def dense(weight: Weight) -> torch.Tensor:
    """The fp32 matrix of ``weight`` (dequantized if it is a ``BlockWeight``)."""
    return weight.dense() if isinstance(weight, BlockWeight) else weight


def dense_product(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None):
    """``x @ weight.T (+ bias)``, ``weight`` fp32 ``[out, in]`` or in blocks: the path above the
    kernels' rows (``pk_gemm``, else MKL)."""
    if (y := gemm_product(x, weight, bias)) is not None:
        return y
    weight = dense(weight)
    if (product := sharded_product(x, weight, bias)) is not None:
        return joined(product)
    if bias is None:
        return x @ weight.t()
    return torch.addmm(bias, x, weight.t())


def dense_added_to(residual, x, weight: Weight, bias) -> torch.Tensor:
    """``residual + dense_product(x, ...)``: in pk_gemm's epilogue, or reading a sharded
    product in place."""
    if (y := gemm_product(x, weight, bias, residual)) is not None:
        return y
    weight = dense(weight)
    if (product := sharded_product(x, weight, bias)) is not None:
        return shards_added_to(residual, product)
    return residual + dense_product(x, weight, bias)


def dense_halves(x, weight: Weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The two column halves of ``dense_product(x, ...)`` (views of a sharded product)."""
    if (y := gemm_product(x, weight, bias)) is not None:
        return column_halves(y)
    weight = dense(weight)
    if (product := sharded_product(x, weight, bias)) is not None:
        return shard_halves(product)
    return column_halves(dense_product(x, weight, bias))


def native_factory():
    """A ``load_weights`` projection factory building ``NativeProjection``s, or None where the
    kernels are unavailable (``native.unavailable_reason()`` says why)."""
    if native.kernels() is None:
        return None

    def make(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> ProjectionBase:
        if weight.shape[1] % 8:  # the kernel reads 8 floats at a time: torch's path
            biases = [] if bias is None else [bias]
            return projection_from_pieces(name, [weight], biases, torch.float32, None)
        return NativeProjection(weight.to(torch.float32), bias)

    return make
