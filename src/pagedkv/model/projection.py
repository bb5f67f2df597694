"""The projections of the model's linear layers: ``ProjectionBase`` (what the layers call),
``Projection`` (fp32 or bf16 in torch, an ``[in, out]`` weight, column shards one a thread: the
path where pagedkv's own kernels do not load, ``native/projection.py``) and the helpers that
read a sharded product in place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Up to this many rows a projection runs as a batch of column shards, one a thread: faster at
# 1-64 rows in every run here (1.1-1.6x), 1.09x at 128, 0.96-1.08x at 256 (a 256-token prompt's
# time to first token: 2.5 % shorter, 10 runs of 12), 0.97x at 512, where torch's mm keeps every
# thread busy itself (benchmarks/bench_projection.py, docs/latency.md).
SHARDED_MAX_ROWS = 256

# ``keep_shards``: the column shards while the engine's runner runs a step on fewer threads.
_kept_shards = 1


def keep_shards(count: int) -> None:
    """Split sharded products into at least ``count`` column shards whatever torch's thread
    count is now: the engine's runner keeps the shards of its full team for a step that
    ``pagedkv/cpu_share.py`` has run on fewer threads, so the products keep their bits
    (MKL's GEMM of a shard on 1 or 2 threads: bit-identical, tests/engine/test_cpu_share.py).
    1 = follow the threads (the runner's reset after the step)."""
    global _kept_shards
    _kept_shards = max(1, count)


def shard_count() -> int:
    """The column shards of a sharded product now: torch's threads, at least ``keep_shards``."""
    return max(torch.get_num_threads(), _kept_shards)


class ProjectionBase(nn.Module):
    """What the layers ask of a projection (``x @ W (+ bias)``, ``[rows, out]``) beyond the
    call: the product added to a residual, and the two halves of its columns. These defaults
    compute the whole product first; ``Projection`` avoids the copy its sharded product needs.
    """

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, a new tensor."""
        return residual + self(x)

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first and the second half of ``self(x)``'s columns (views or new tensors)."""
        return column_halves(self(x))


class Projection(ProjectionBase):
    """``x @ weight_t (+ bias)``: a linear layer whose weight is stored transposed, ``[in, out]``.

    At one row (batch-1 decode) torch's CPU GEMV streams an ``[in, out]`` matrix faster than
    nn.Linear's ``[out, in]`` one (the 30 layers of the embedded model: 32 vs 48 ms on one
    machine, 26 vs 34 ms on another); from 16 rows up the two are within 5-10 %. With several
    threads, up to ``SHARDED_MAX_ROWS`` rows are multiplied as a batch of column shards, one a
    thread (see ``_sharded``). Quantized variants with the same call live in ``quant.py``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # (threads, weight_t, bias: what it views; weight as [threads, in, out / threads], and
        # the bias as [threads, 1, out / threads]), rebuilt when any of the three changes.
        self._shards: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self._sharded(x)
        if product is not None:
            return joined(product)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        product = self._sharded(x)
        if product is None:
            return residual + self.forward(x)
        return shards_added_to(residual, product)

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = self._sharded(x)
        if product is None:
            return column_halves(self.forward(x))
        return shard_halves(product)

    def _sharded(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight_t`` as ``[threads, rows, out / threads]``: one ``bmm`` over ``threads``
        column shards of the weight (views, no copy); None where the plain ``mm`` is the path
        (one thread, more than ``SHARDED_MAX_ROWS`` rows, columns that do not split evenly, not
        fp32, or under torch.compile, whose own matmul choice the shard cache would only
        recompile). In bf16 the plain ``mm`` goes to oneDNN, which beat the shards 2-6x at 1-256
        rows on an AVX-512/AMX Xeon (the lm_head at 64 rows: 3.0 vs 19.4 ms).

        On an AVX2 machine torch's CPU ``mm`` of one row read the weights at the same 24-26 GB/s
        at 1 and 2 threads (one thread did the work) while ``bmm`` gives each shard a thread
        (30-31 GB/s; 1.1-1.6x at 1-64 rows). Every output column is the same dot product either
        way: the results were bit-identical (docs/latency.md)."""
        threads = shard_count()
        if (
            threads == 1
            or not x.is_cpu  # a GPU's GEMM spreads over its own cores
            or x.dtype
            != torch.float32  # bf16: oneDNN's mm (AMX where the CPU has it) is 2-6x the bmm
            or x.shape[0] > SHARDED_MAX_ROWS
            or self.out_features % threads
            or torch.compiler.is_compiling()
        ):
            return None
        weight, bias, cached = self.weight_t, self.bias, self._shards
        if (
            cached is None
            or cached[0] != threads
            or cached[1] is not weight
            or cached[2] is not bias
        ):
            k, n = weight.shape
            shards = weight.view(k, threads, n // threads).permute(1, 0, 2)
            bias_shards = None if bias is None else bias.view(threads, 1, n // threads)
            cached = self._shards = (threads, weight, bias, shards, bias_shards)
        rows = x.expand(threads, *x.shape)
        if cached[4] is None:
            return torch.bmm(rows, cached[3])
        return torch.baddbmm(cached[4], rows, cached[3])

    def dense_weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` (a view)."""
        return self.weight_t.t()

    def describe(self) -> str:
        dtype = str(self.weight_t.dtype).removeprefix("torch.")
        if not self.weight_t.is_cpu:
            return f"{dtype} matmuls on {self.weight_t.device} (torch / cuBLAS)"
        if self.weight_t.dtype != torch.float32:
            return f"{dtype} matmuls (torch / oneDNN)"
        return (
            f"{dtype} matmuls; up to {SHARDED_MAX_ROWS} rows as one bmm over a column shard "
            "per torch thread (when there are several)"
        )


def shards_added_to(residual: torch.Tensor, product: torch.Tensor) -> torch.Tensor:
    """``residual + product`` joined, for a product ``[threads, rows, out / threads]`` of
    column shards: the residual is seen as shards, so that the add reads the product where
    the bmm wrote it instead of a transposed copy first (a 256-row prefill: 60 copies fewer)."""
    threads, rows, width = product.shape
    if rows == 1 or not residual.is_contiguous():
        return residual + joined(product)
    shards_view = residual.view(rows, threads, width)
    return torch.add(shards_view, product.transpose(0, 1)).reshape(rows, threads * width)


def shard_halves(product: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second half of the columns of a column-shard product. With an even
    number of shards the first half of them holds the first half of the columns: views at 2
    threads or at one row (gate and up of a 256-row prefill: no copy)."""
    threads, rows, width = product.shape
    if threads % 2:
        return column_halves(joined(product))
    pairs = product.view(2, threads // 2, rows, width).transpose(1, 2)
    first, second = pairs.reshape(2, rows, threads // 2 * width).unbind()
    return first, second


def joined(product: torch.Tensor) -> torch.Tensor:
    """``[threads, rows, out / threads]`` -> ``[rows, out]``: a view at one row, a copy above."""
    threads, rows, width = product.shape
    return product.transpose(0, 1).reshape(rows, threads * width)


def column_halves(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second half of ``out``'s columns (views)."""
    half = out.shape[1] // 2
    return out[:, :half], out[:, half:]


def projection_from_pieces(
    name: str,
    pieces: list[torch.Tensor],
    biases: list[torch.Tensor],
    dtype: torch.dtype,
    make_projection: Callable[[str, torch.Tensor, torch.Tensor | None], ProjectionBase] | None,
) -> ProjectionBase:
    """One projection from the row pieces of its weight (fused here) and of its bias."""
    bias = torch.cat(biases).to(dtype) if biases else None
    if make_projection is not None:
        return make_projection(name, torch.cat(pieces) if len(pieces) > 1 else pieces[0], bias)
    in_features = pieces[0].shape[1]
    out_features = sum(p.shape[0] for p in pieces)
    module = Projection(in_features, out_features, bias=bias is not None)
    # Each piece is written transposed straight into its columns: one copy, no fused temporary.
    weight_t = torch.empty(in_features, out_features, dtype=dtype, device=pieces[0].device)
    col = 0
    for piece in pieces:
        _copy_transposed(weight_t[:, col : col + piece.shape[0]], piece.to(dtype))
        col += piece.shape[0]
    module.weight_t = nn.Parameter(weight_t, requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return module


def _copy_transposed(dst: torch.Tensor, src: torch.Tensor, rows_per_block: int = 256) -> None:
    """``dst[:] = src.T`` by blocks of source rows: a whole-matrix strided copy thrashes the
    cache (the 49k x 576 lm_head: 110 ms in torch, 40 ms in 256-row blocks; numpy's copy of a
    transposed block is ~2.5x torch's on this CPU; bf16, which numpy lacks, stays in torch)."""
    numpy_ok = (
        dst.is_cpu and src.is_cpu and src.dtype in (torch.float32, torch.float16, torch.float64)
    )
    for start in range(0, src.shape[0], rows_per_block):
        block = src[start : start + rows_per_block]
        if numpy_ok:
            dst[:, start : start + rows_per_block].numpy()[:] = block.numpy().T  # host: is_cpu
        else:
            dst[:, start : start + rows_per_block].copy_(block.t())
