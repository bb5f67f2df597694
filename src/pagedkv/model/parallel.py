"""Tensor parallelism inside one rank's model: the parallel linears and their collectives.

A rank's ``CausalLM`` has the shape of its share (``shards.py``): its QKV and gate/up products
are column-parallel as loaded (each rank computes its own heads and MLP rows, no
communication). What needs the other ranks is here:

- ``RowParallel``: ``o_proj`` and ``down_proj`` hold the input columns of this rank's heads and
  MLP rows, so each rank's product is a partial sum; one all-reduce a projection makes it the
  whole one. It is the projection's own op (``forward`` and ``added_to``), so the one decoder
  layer (``decoder_layer.py``) calls it in its order and no backend names it;
- ``VocabShard``: the embedding and the LM head hold ``ceil(vocab / N)`` vocabulary rows each;
  an id outside a rank's rows embeds as zeros there and one all-reduce sums the one rank's row
  (exact: the others add zeros); the logits of each rank's rows are gathered onto rank 0.

``TPGroup`` is the rank's place and its collectives over ``torch.distributed`` (gloo on CPUs,
NCCL on GPUs: device tensors in, no host read, nothing synchronised per layer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from pagedkv.model.projection import ProjectionBase
from pagedkv.model.shards import SLICES, RankShard
from pagedkv.model.weights import PROJECTIONS

# The layer's projections whose weights a rank slices by input columns (``shards.SLICES``):
# their products are partial sums. Read off the weight tables, not named here.
ROW_PARALLEL = tuple(ours for ours, (pieces, _) in PROJECTIONS.items() if SLICES[pieces[0]][0] == 1)


class TPGroup:
    """Rank ``rank`` of ``size`` and its collectives: on ``group`` (a ``torch.distributed``
    process group of the device; None = the default one) the model's, on ``cpu_group`` (gloo;
    None = ``group``) host bytes. ``reduce_s`` / ``num_reduces``: the wall time and count of
    all-reduces while ``timed`` (the benchmarks' share of a step; on a GPU the time is the
    launch's, the collective runs on the stream)."""

    def __init__(
        self,
        rank: int,
        size: int,
        group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.cpu_group = cpu_group if cpu_group is not None else group
        self.timed = False
        self.reduce_s = 0.0
        self.num_reduces = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place (``x`` made contiguous first)."""
        x = x.contiguous()
        started = time.perf_counter() if self.timed else 0.0
        dist.all_reduce(x, group=self.group)
        if self.timed:
            self.reduce_s += time.perf_counter() - started
            self.num_reduces += 1
        return x

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (``x``: a tensor of the same shape and dtype on each,
        overwritten off rank 0)."""
        x = x.contiguous()
        dist.broadcast(x, src=0, group=self.group)
        return x

    def gather_bytes(self, data: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's host ``uint8`` tensor ``data`` (one length on each), in rank order, on
        rank 0 (None on the others): over the host group."""
        if self.rank != 0:
            dist.gather(data, None, dst=0, group=self.cpu_group)
            return None
        parts = [torch.empty_like(data) for _ in range(self.size)]
        dist.gather(data, parts, dst=0, group=self.cpu_group)
        return parts

    def scatter_bytes(self, parts: list[torch.Tensor] | None, nbytes: int) -> torch.Tensor:
        """Rank ``r``'s ``parts[r]`` (host ``uint8``, ``nbytes`` each; given on rank 0 only)."""
        out = torch.empty(nbytes, dtype=torch.uint8)
        dist.scatter(out, parts if self.rank == 0 else None, src=0, group=self.cpu_group)
        return out

    def gather_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` (one shape) stacked ``[size, *x.shape]`` on rank 0; None on the
        others."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.stack(parts)


class TensorRank(NamedTuple):
    """What ``loader.load_model`` needs to load one rank's model: its share and its group."""

    shard: RankShard
    group: TPGroup


class RowParallel(ProjectionBase):
    """``all_reduce(x @ W_r)``: ``inner`` holds this rank's input columns (any projection:
    pagedkv's kernels, torch, quantized). No bias: it would be added once per rank."""

    def __init__(self, inner: ProjectionBase, group: TPGroup) -> None:
        super().__init__()
        if getattr(inner, "bias", None) is not None:
            raise ValueError("a row-parallel projection with a bias is not supported")
        self.inner, self.group = inner, group
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def describe(self) -> str:
        return f"{self.inner.describe()}, row-parallel over {self.group.size} ranks"


class VocabShard:
    """The vocab-parallel ends of a rank's model: rows ``[start, start + rows)`` of a
    vocabulary of ``vocab_size`` (the last rank's rows past it are zeros)."""

    def __init__(self, group: TPGroup, start: int, rows: int, vocab_size: int) -> None:
        self.group, self.start, self.rows, self.vocab_size = group, start, rows, vocab_size

    def embed(
        self, input_ids: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``[T, H]`` embeddings of ``input_ids`` (the whole vocabulary's ids) from ``lookup``
        of this rank's local ids, summed over the ranks."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        rows = lookup(torch.where(inside, local, torch.zeros_like(local)))
        return self.group.all_reduce(rows * inside.unsqueeze(1).to(rows.dtype))

    def logits(self, hidden: torch.Tensor, lm_head: torch.nn.Module) -> torch.Tensor:
        """fp32 ``[N, vocab]`` logits on rank 0 (this rank's ``[N, rows]`` elsewhere)."""
        local = lm_head(hidden).float()
        parts = self.group.gather_first(local)
        if parts is None:
            return local
        return parts.permute(1, 0, 2).reshape(local.shape[0], -1)[:, : self.vocab_size]


def parallelize(model, group: TPGroup, shard: RankShard) -> None:
    """Make ``model`` (a ``CausalLM`` of ``shard.local_config()``, weights loaded) rank
    ``group.rank``'s: its row-parallel projections all-reduced, its ends vocab-parallel. Before
    its attention backend is built (the native decode chain then sees a layer it cannot run in
    one call, and runs it op by op)."""
    for layer in model.layers:
        for name in ROW_PARALLEL:
            owner, _, leaf = name.rpartition(".")
            parent = layer.get_submodule(owner) if owner else layer
            setattr(parent, leaf, RowParallel(parent.get_submodule(leaf), group))
    model.vocab_shard = VocabShard(
        group, shard.vocab_start, shard.vocab_rows, shard.config.vocab_size
    )
