"""``ModelRunner``: one ``ScheduledBatch`` in, the logits of the rows that need a token out.

It owns the KV pools of every layer and turns the scheduler's plan into the model's inputs:
input ids, positions, the slot mapping (where each new token's K/V goes), the padded block
tables, the context lengths and the query start offsets. All of it comes from the allocator, so
the paged, radix and reserved allocators drive the model through the same path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from pagedkv.cpu_share import CpuShare, usable_cores
from pagedkv.engine.device_copies import host_tensor, to_device
from pagedkv.engine.kv.mover import KVMover
from pagedkv.engine.kv.swap_pool import HostSwapPool
from pagedkv.engine.step.draws import PendingDraws
from pagedkv.engine.step.timeline import NULL_TIMELINE, NullTimeline, StepTimeline
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.model.attention_backend import AttentionBackend
from pagedkv.model.attention_metadata import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.graphs import DecodeGraphs
from pagedkv.model.kv_pool import KVCache, allocate_kv_caches
from pagedkv.model.llama import CausalLM
from pagedkv.model.projection import keep_shards
from pagedkv.pages.page_format import PageFormat
from pagedkv.sched.batch import ScheduledBatch


@dataclass(frozen=True)
class StepInputs:
    """The tensors of one forward pass (exposed for tests and benchmarks)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    logit_rows: torch.Tensor  # int64 [R]: index in [T] of each last token that needs logits
    # Prompt positions scored for prompt logprobs (``Seq.scores_prompt``): ``prompt_rows`` index
    # [T]; ``prompt_spans`` (entry of batch.seqs, first position, count), in that order.
    prompt_rows: torch.Tensor = torch.empty(0, dtype=torch.int64)
    prompt_spans: tuple[tuple[int, int, int], ...] = ()
    # (index in [T], seq_id) of each token scheduled before it was drawn (its id on the host is
    # ``PLACEHOLDER``; the previous step's draws hold it on the device).
    placeholders: tuple[tuple[int, int], ...] = ()


class PromptHidden(NamedTuple):
    """The final hidden states of prompt positions ``[first_position, + len(hidden))`` of entry
    ``entry`` of ``batch.seqs``: row ``j`` predicts prompt token ``first_position + j + 1``."""

    entry: int
    first_position: int
    hidden: torch.Tensor  # [count, hidden_size]


class StepOutput(NamedTuple):
    logits: torch.Tensor  # fp32 [R, vocab], the entries that need a token, in batch order
    prompt_hidden: list[PromptHidden]


class ModelRunner:
    """Holds the model and its KV pools ``[num_blocks, block_size, kv_heads, head_dim]`` per
    layer, on the model's device. ``execute`` mutates the pools (new K/V, copy-on-write copies)
    and nothing else. The step's tensors are made on the host (pinned on a GPU); the model and
    the attention plan move them."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        page: PageFormat,
        num_blocks: int,
        num_host_blocks: int = 0,
        backend: AttentionBackend | None = None,
    ) -> None:
        """A pool of ``num_blocks`` pages of ``page`` (its block size, heads, head dim and KV
        dtype). ``num_host_blocks`` > 0 adds a host swap pool of that many blocks (swap
        preemption; the scheduler's ``SwapSpace`` hands out its block ids). ``backend``: the
        attention backend (``model/attention_backend.py``); None = the model's default (the
        native C kernels on the CPU, else torch SDPA)."""
        if backend is None and model is not None:  # model None: tests of the pool's layout
            backend = model.default_backend()
        self.backend = backend
        self.model = model
        self.config = config
        self.page = page
        self.block_size = page.block_size
        self.num_blocks = num_blocks  # physical blocks, the null block included
        self.device = torch.device("cpu") if model is None else model.device  # None: layout tests
        self.kv_caches: list[KVCache] = allocate_kv_caches(page, num_blocks, self.device)
        swap_pool = None
        if num_host_blocks:
            swap_pool = HostSwapPool(page, num_host_blocks, self.device)
        # Every KV copy of a step (swap, copy-on-write, lower tiers, which start-up attaches);
        # copy-on-write on the backend's own block copy.
        copy_blocks = None if backend is None else backend.copy_blocks
        self.mover = KVMover(self.kv_caches, swap_pool, copy_blocks)
        # On a GPU the step's host tensors are pinned, so their copies to it run asynchronously.
        self._pin = self.device.type == "cuda"
        self.timeline: StepTimeline | NullTimeline = NULL_TIMELINE  # the engine attaches one
        self.graphs: DecodeGraphs | None = None  # ``capture_graphs``: CUDA graphs of decode
        self.cpu_share: CpuShare | None = None  # ``share_cpu``: threads step by step

    def share_cpu(self, adapt: bool) -> str:
        """On the CPU, the threads of each step: with ``adapt``, as many as the cores other
        processes left free (``pagedkv/cpu_share.py``), at most torch's count now, the
        column shards of that count kept; else that count always. The start-up line."""
        if self.device.type != "cpu":
            return ""
        ceiling = torch.get_num_threads()
        if not adapt or ceiling == 1:
            return f"threads: {ceiling} (torch's intra-op threads; pagedkv's kernels use them too)"
        self.cpu_share = CpuShare(ceiling, usable_cores())
        return (
            f"threads: {ceiling}, fewer while other processes hold cores (the same tokens; "
            "--fixed-threads: always the same count)"
        )

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, graph_factory=None) -> str:
        """Record the decode steps' CUDA graphs (Triton backend; ``graph_factory`` for tests);
        returns the start-up line."""
        max_blocks = -(-max_model_len // self.block_size)
        if self.backend is None:
            raise ValueError("CUDA graphs need an attention backend")
        graphs = DecodeGraphs(
            self.model,
            self.backend,
            self.kv_caches,
            self.block_size,
            max_num_seqs,
            max_blocks,
            graph_factory,
        )
        graphs.capture()
        self.graphs = graphs
        sizes = ",".join(map(str, graphs.buckets))
        return f"CUDA graphs of decode steps captured for batch sizes {sizes}"

    @property
    def swap_pool(self) -> HostSwapPool | None:
        return self.mover.swap_pool

    @property
    def kv_cache_bytes(self) -> int:
        return sum(pool.numel() * pool.element_size() for pair in self.kv_caches for pool in pair)

    def prepare(self, batch: ScheduledBatch, allocator: KVAllocator) -> StepInputs:
        """Build the step's tensors from the batch and the allocator's block tables."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        query_start = [0]
        logit_rows: list[int] = []
        prompt_rows: list[int] = []
        spans: list[tuple[int, int, int]] = []
        placeholders: list[tuple[int, int]] = []
        for entry, item in enumerate(batch.seqs):
            seq, start = item.seq, item.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            if end > seq.num_known_tokens:  # the last token, drawn by the step before
                placeholders.append((len(input_ids) - 1, seq.seq_id))
            positions.extend(range(start, end))
            slots.extend(allocator.slot_mapping(seq, start, end))
            context_lens.append(end)
            query_start.append(query_start[-1] + item.num_new_tokens)
            if item.needs_logits:
                logit_rows.append(query_start[-1] - 1)
            # The last prompt position predicts the first output token: sampled, not scored.
            scored_end = min(end, seq.num_prompt_tokens - 1)
            if seq.scores_prompt and scored_end > start:
                spans.append((entry, start, scored_end - start))
                prompt_rows.extend(range(query_start[-2], query_start[-2] + scored_end - start))
        tables, width = allocator.block_tables([item.seq for item in batch.seqs])
        host = self._host_tensor
        metadata = AttentionMetadata(
            slot_mapping=host(slots, torch.int64),
            block_tables=host(tables, torch.int32).view(len(batch.seqs), width),
            context_lens=host(context_lens, torch.int32),
            query_start_loc=host(query_start, torch.int32),
        )
        return StepInputs(
            host(input_ids, torch.int64),
            host(positions, torch.int64),
            metadata,
            host(logit_rows, torch.int64),
            host(prompt_rows, torch.int64),
            tuple(spans),
            tuple(placeholders),
        )

    def _drawn_ids(self, inputs: StepInputs, prev: PendingDraws | None) -> torch.Tensor:
        """The step's input ids on the device, each placeholder's taken from ``prev``'s draws
        there (one gather and one scatter: the host never waits for them)."""
        if prev is None or prev.draws is None:
            raise RuntimeError("a token scheduled ahead, but no draws of the step before")
        where, rows = zip(*((i, prev.token_rows[s]) for i, s in inputs.placeholders), strict=True)
        ids = inputs.input_ids.to(self.device, non_blocking=True)
        drawn = prev.draws.token_ids
        ids[to_device(where, torch.int64, self.device)] = drawn[
            to_device(rows, torch.int64, drawn.device)
        ]
        return ids

    def _host_tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A step tensor made on the host, pinned when the model runs on a GPU: the copies
        there (``.to(device, non_blocking=True)``) then overlap instead of blocking."""
        return host_tensor(values, dtype, self._pin)

    def execute(
        self, batch: ScheduledBatch, allocator: KVAllocator, prev: PendingDraws | None = None
    ) -> StepOutput:
        """Run the step: ``prepare`` -> ``mover.before_forward`` (offloads, swaps, copy-on-write
        copies, loads) -> the forward pass -> ``mover.after_forward`` (write-through saves) ->
        fp32 logits ``[R, vocab]`` for the entries of ``batch.seqs`` that need logits, in batch
        order, plus the hidden states of the prompt positions to score
        (``engine/prompt_scoring.py`` turns them into logprobs). ``prev``: the previous step's
        draws, still on the device, when this step computes tokens scheduled before they were
        drawn (an asynchronous engine): their ids are read from there, on the device."""
        with self._step_threads():
            inputs = self.prepare(batch, allocator) if batch.seqs else None
            self.timeline.mark("prepare")
            return self.run_step(batch, inputs, prev)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of hidden rows outside a step (prompt scoring)."""
        return self.model.compute_logits(hidden)

    @contextmanager
    def _step_threads(self) -> Iterator[None]:
        """The step on ``cpu_share``'s thread count where it is below torch's, the column
        shards of torch's count kept; torch's count (and the shards) restored after."""
        full = torch.get_num_threads()
        threads = full if self.cpu_share is None else self.cpu_share.threads()
        if threads >= full:
            yield
            return
        torch.set_num_threads(threads)
        keep_shards(full)
        try:
            yield
        finally:
            keep_shards(1)
            torch.set_num_threads(full)

    def run_step(  # the step from its prepared inputs: what every tensor-parallel rank runs
        self, batch: ScheduledBatch, inputs: StepInputs | None, prev: PendingDraws | None
    ) -> StepOutput:
        tl = self.timeline
        self.mover.before_forward(batch)
        tl.mark("kv_copies")
        if inputs is None:
            return StepOutput(torch.empty(0, self.config.vocab_size), [])
        tl.forward_started()
        if inputs.placeholders:
            inputs = replace(inputs, input_ids=self._drawn_ids(inputs, prev))
        meta = inputs.metadata
        if (
            self.graphs is not None
            and not inputs.prompt_spans
            and inputs.logit_rows.numel() == meta.num_tokens == meta.num_seqs
        ):
            # A decode step (every row one sequence's new token, each needing its logits).
            logits = self.graphs.run(inputs.input_ids, inputs.positions, meta)
            if logits is not None:
                tl.forward_ended()
                tl.mark("forward")
                self.mover.after_forward(batch)
                tl.mark("kv_saves")
                return StepOutput(logits, [])
        plan = self.backend.plan(meta, self.kv_caches, self.block_size)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, meta, self.block_size, plan
        )
        tl.mark("forward")
        self.mover.after_forward(batch)
        tl.mark("kv_saves")
        prompt = []
        if inputs.prompt_spans:
            rows = hidden[inputs.prompt_rows.to(hidden.device, non_blocking=True)].split(
                [n for _, _, n in inputs.prompt_spans]
            )
            prompt = [
                PromptHidden(e, first, h)
                for (e, first, _), h in zip(inputs.prompt_spans, rows, strict=True)
            ]
        logits = torch.empty(0, self.config.vocab_size)
        if inputs.logit_rows.numel():
            last = hidden[inputs.logit_rows.to(hidden.device, non_blocking=True)]
            logits = self.model.compute_logits(last)
        tl.forward_ended()
        tl.mark("forward")  # the LM head: the forward's last part
        return StepOutput(logits, prompt)
