"""The position-wise building blocks: projections, RMSNorm, rotary embeddings (plain and llama3),
SwiGLU."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.planner.shape import Llama3RopeScaling

# Up to this many rows a projection runs as a batch of column shards, one a thread: faster at
# 1-64 rows in every run here (1.1-1.6x), 1.09x at 128, 0.96-1.08x at 256 (a 256-token prompt's
# time to first token: 2.5 % shorter, 10 runs of 12), 0.97x at 512, where torch's mm keeps every
# thread busy itself (benchmarks/bench_projection.py, docs/latency.md).
SHARDED_MAX_ROWS = 256


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
        return _split(self(x))


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
            return _split(self.forward(x))
        return shard_halves(product)

    def _sharded(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight_t`` as ``[threads, rows, out / threads]``: one ``bmm`` over ``threads``
        column shards of the weight (views, no copy); None where the plain ``mm`` is the path
        (one thread, more than ``SHARDED_MAX_ROWS`` rows, columns that do not split evenly, or
        under torch.compile, whose own matmul choice the shard cache would only recompile).

        On an AVX2 machine torch's CPU ``mm`` of one row read the weights at the same 24-26 GB/s
        at 1 and 2 threads (one thread did the work) while ``bmm`` gives each shard a thread
        (30-31 GB/s; 1.1-1.6x at 1-64 rows). Every output column is the same dot product either
        way: the results were bit-identical (docs/latency.md)."""
        threads = torch.get_num_threads()
        if (
            threads == 1
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
        return _split(joined(product))
    pairs = product.view(2, threads // 2, rows, width).transpose(1, 2)
    first, second = pairs.reshape(2, rows, threads // 2 * width).unbind()
    return first, second


def joined(product: torch.Tensor) -> torch.Tensor:
    """``[threads, rows, out / threads]`` -> ``[rows, out]``: a view at one row, a copy above."""
    threads, rows, width = product.shape
    return product.transpose(0, 1).reshape(rows, threads * width)


def _split(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    weight_t = torch.empty(in_features, out_features, dtype=dtype)
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
    numpy_ok = src.dtype in (torch.float32, torch.float16, torch.float64)
    for start in range(0, src.shape[0], rows_per_block):
        block = src[start : start + rows_per_block]
        if numpy_ok:
            dst[:, start : start + rows_per_block].numpy()[:] = block.numpy().T
        else:
            dst[:, start : start + rows_per_block].copy_(block.t())


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
                x.data_ptr(), self.weight.data_ptr(), y.data_ptr(), rows, hidden, self.eps,
                torch.get_num_threads(),
            )  # fmt: skip
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


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Projection(hidden_size, 2 * intermediate_size)
        self.down_proj = Projection(intermediate_size, hidden_size)
        self.kernels = None  # native.kernels(), set by the loader in fp32: silu * up in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._gated(x))

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, a new tensor (the projections' copy-free paths)."""
        return self.down_proj.added_to(residual, self._gated(x))

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
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
                gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
                rows, half, torch.get_num_threads(),
            )  # fmt: skip
            return out
        return F.silu(gate).mul_(up)
