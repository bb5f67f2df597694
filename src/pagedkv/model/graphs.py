"""``DecodeGraphs``: decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step of a small model on a GPU is mostly launch overhead: dozens of kernels a layer,
each a few microseconds of work. A CUDA graph records a whole forward (embedding, every layer,
the final norm and the logits) once per bucket and replays it as one launch. What a replay
reads lives in static device buffers, refilled before each replay:

* input ids, positions, slot mapping, block tables (``max_blocks`` wide), context lengths;
* a step of ``n`` sequences runs in the smallest bucket ``>= n``; rows ``n..bucket`` are
  padding: slot -1 (the KV write skips it), context 0 (attention reads nothing, writes 0),
  token 0 at position 0; their logits are dropped.

The backend's graph plan (``AttentionBackend.graph_plan``; of the backends in
``pages/backends.py``, those with ``cuda_graphs``: the Triton decode plan) reads only those
buffers and fixes what it decides per step at capture (Triton's split count: the rule's choice
at the longest context the table holds), so a replay needs no host value.
Steps with a prompt chunk, or more sequences than the largest bucket, run eagerly.

``graph_factory`` makes the graph objects; on a GPU ``torch.cuda.CUDAGraph``. Tests on the CPU
pass a stand-in that re-runs the recorded function, which exercises everything here but the
recording itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.model.attention_backend import AttentionBackend
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.kv_pool import KVCache
from pagedkv.model.llama import CausalLM


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to 64, then of 32, and ``max_num_seqs`` itself:
    at most 12.5 % of a replay is padding once batches pass 8."""
    sizes = {1, 2, 4, *range(8, 65, 8), *range(96, max_num_seqs + 1, 32), max_num_seqs}
    return tuple(sorted(s for s in sizes if s <= max_num_seqs))


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``kv_caches``, each step's ops planned by
    ``backend.graph_plan`` over the static buffers."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        block_size: int,
        max_num_seqs: int,
        max_blocks: int,
        graph_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = max_blocks
        device, n = model.device, self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._factory = graph_factory or torch.cuda.CUDAGraph
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.replays = 0  # decode steps served from a graph (the rest ran eagerly)

    def _forward(self, n: int) -> torch.Tensor:
        """The recorded computation of bucket ``n``: fp32 logits ``[n, vocab]``."""
        meta = AttentionMetadata(
            self.slot_mapping[:n],
            self.block_tables[:n],
            self.context_lens[:n],
            self.query_start_loc[: n + 1],
        )
        model = self.model
        plan = self.backend.graph_plan(meta, self.block_size, self.max_blocks * self.block_size)
        if plan is None:
            raise ValueError(f"the {self.backend.rule.name} attention backend has no CUDA graphs")
        hidden = model(
            self.input_ids[:n], self.positions[:n], self.kv_caches, meta, self.block_size, plan
        )
        return model.compute_logits(hidden)

    def capture(self) -> None:
        """Record every bucket, largest first (smaller graphs reuse its memory pool). Each is
        run once eagerly first: Triton compiles its kernels outside the recording. The padded
        rows write nothing (slot -1), so capturing leaves the KV pool as it was."""
        on_gpu = self._factory is torch.cuda.CUDAGraph
        pool = torch.cuda.graph_pool_handle() if on_gpu else None
        for n in reversed(self.buckets):
            self._forward(n)  # warm-up: compile, allocate the kernels' scratch
            graph = self._factory()
            if on_gpu:
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(n)
            else:
                logits = graph.record(lambda n=n: self._forward(n))
            self._graphs[n] = (graph, logits)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """fp32 logits ``[n, vocab]`` of a decode step (host tensors, one token per sequence)
        from its bucket's graph; None when the step is not one a graph holds."""
        n = meta.num_seqs
        if meta.num_tokens != n or n > self.buckets[-1] or not self._graphs:
            return None
        width = meta.block_tables.shape[1]
        if width > self.max_blocks:
            return None
        bucket = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        # Padding rows: nothing written, nothing read.
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].fill_(0)
        self.input_ids[n:bucket].fill_(0)
        self.positions[n:bucket].fill_(0)
        graph, logits = self._graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:n].clone()  # the next replay overwrites the static output
