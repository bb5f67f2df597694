"""Test-side paging: a trivial (but shuffled) block assignment that builds AttentionMetadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv.model import AttentionMetadata, CausalLM, allocate_kv_caches
from pagedkv.pages.layout import layout_from_shape
from pagedkv.pages.page_format import PageFormat


@dataclass
class Chunk:
    """New tokens ``[start, end)`` of sequence ``seq`` in one step."""

    seq: int
    start: int
    end: int


class BlockAssigner:
    """Each sequence owns ``ceil(max_len / block_size)`` physical blocks, in shuffled order, so
    that block tables are really followed (block 0, the padding id, is a real block too)."""

    def __init__(self, num_seqs: int, max_len: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        blocks_per_seq = math.ceil(max_len / block_size)
        self.num_blocks = num_seqs * blocks_per_seq
        order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed))
        self.tables = order.view(num_seqs, blocks_per_seq).to(torch.int32)

    def step(self, chunks: list[Chunk]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions ``[T]`` and metadata for one step made of ``chunks`` (in batch order)."""
        positions = torch.cat([torch.arange(c.start, c.end) for c in chunks])
        seqs = torch.cat([torch.full((c.end - c.start,), c.seq) for c in chunks])
        blocks = self.tables[seqs, positions // self.block_size].to(torch.int64)
        slots = blocks * self.block_size + positions % self.block_size
        ctx = torch.tensor([c.end for c in chunks], dtype=torch.int32)
        used = max(math.ceil(c.end / self.block_size) for c in chunks)
        tables = self.tables[[c.seq for c in chunks], :used]
        # Pad beyond each sequence's own blocks with 0, as the engine will.
        for row, c in enumerate(chunks):
            tables[row, math.ceil(c.end / self.block_size) :] = 0
        lens = torch.tensor([0] + [c.end - c.start for c in chunks])
        starts = torch.cumsum(lens, 0).to(torch.int32)
        return positions, AttentionMetadata(slots, tables.contiguous(), ctx, starts)


def run_steps(
    model: CausalLM,
    sequences: list[list[int]],
    steps: list[list[Chunk]],
    block_size: int,
    max_len: int,
) -> list[torch.Tensor]:
    """Teacher-forced paged run: fp32 logits ``[T, V]`` of every step's new tokens."""
    cfg = model.config
    assigner = BlockAssigner(len(sequences), max_len, block_size)
    kv = allocate_kv_caches(page_of(cfg, block_size, model.dtype), assigner.num_blocks)
    out = []
    for chunks in steps:
        positions, meta = assigner.step(chunks)
        ids = torch.tensor([t for c in chunks for t in sequences[c.seq][c.start : c.end]])
        out.append(model.compute_logits(model(ids, positions, kv, meta)))
    return out


def page_of(cfg, block_size: int, dtype: torch.dtype = torch.float32) -> PageFormat:
    """The page of ``cfg``'s pools in blocks of ``block_size``, K/V (or MLA's latent records)
    in ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    if cfg.mla is not None:
        return PageFormat.from_layout(layout_from_shape(cfg.model_shape(), name), block_size)
    return PageFormat.mha(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, name, block_size)


def greedy_paged(
    model: CausalLM, prompts: list[list[int]], num_new_tokens: int, block_size: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decoding through the paged cache: one prefill step for all prompts, then
    one decode step per token. Returns the new tokens and each prompt's prefill logits."""
    cfg = model.config
    max_len = max(len(p) for p in prompts) + num_new_tokens
    assigner = BlockAssigner(len(prompts), max_len, block_size)
    kv = allocate_kv_caches(page_of(cfg, block_size, model.dtype), assigner.num_blocks)
    chunks = [Chunk(i, 0, len(p)) for i, p in enumerate(prompts)]
    positions, meta = assigner.step(chunks)
    logits = model.compute_logits(model(torch.tensor(sum(prompts, [])), positions, kv, meta))
    bounds = meta.query_start_loc.tolist()
    prefill_logits = [logits[bounds[i] : bounds[i + 1]] for i in range(len(prompts))]
    generated = [[int(lg[-1].argmax())] for lg in prefill_logits]
    for _ in range(num_new_tokens - 1):
        chunks = [
            Chunk(i, len(p) + len(g) - 1, len(p) + len(g))
            for i, (p, g) in enumerate(zip(prompts, generated, strict=True))
        ]
        positions, meta = assigner.step(chunks)
        ids = torch.tensor([g[-1] for g in generated])
        logits = model.compute_logits(model(ids, positions, kv, meta))
        for g, row in zip(generated, logits, strict=True):
            g.append(int(row.argmax()))
    return generated, prefill_logits
