"""A step's time on pagedkv's own engine, from an ``EngineClock`` (``sim/pagedkv_triton/clock.py``).

A step is host work and GPU work. The GPU runs, per layer, the four projections over the
step's ``m`` new tokens, every other kernel of the layer (``gpu_per_token_s * m``) and one
attention kernel: a step of decode rows only runs the paged decode kernel (its split count by
the kernel's own rule, ``pages/triton_splits.decode_splits``, for the longest context; the
law's walk over the mean context and, after it, the longest sequence's chain beyond the mean:
``sim/pagedkv_triton/step_context.py``, ``sim/pagedkv_triton/decode_law.py``; a shape that does not know its longest
context is priced as if every context were the mean); any other
step runs the prefill kernel over every sequence, a decode row being a tile of one query row
there (what makes a mixed step's decode rows dear); once a step, the LM head over the sampled
rows. The host schedules, builds the inputs, samples and hands the tokens back (``host_s``:
per step, per sequence, per block-table entry, per new token) and, eagerly, launches the
forward's kernels
(``launch_per_layer_s`` per layer), which the GPU's work hides in part::

    eager:                 host + (launch^p + gpu^p)^(1/p)         p = overlap_p
    decode, CUDA graphs:   host + graph_replay_s + gpu

A step that computes nothing costs ``host``. ``tp`` > 1 prices one rank of a tensor-parallel
engine (``engine/ranks/``): its share of the projections, heads and vocabulary, two ring
all-reduces of the step's activations a layer over the GPU's link (``vllm_class/clock.py``'s
``all_reduce_s``, the one owner), and no CUDA graphs (the engine captures none at TP > 1); the
step message to the workers and the logits' gather are not priced (no measurement yet).
``model`` may differ from the model the clock was fitted on: rates come from the GPU's
datasheet, shapes from the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.pages.triton_splits import decode_splits
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.pagedkv_triton.clock import EngineClock
from pagedkv.sim.pagedkv_triton.decode_law import DecodeCall, decode_call_s, token_cost_ratio
from pagedkv.sim.pagedkv_triton.step_context import longest_context_tokens
from pagedkv.sim.vllm_class import clock as gc
from pagedkv.sim.vllm_class.cost import layer_gemms_s

PREFILL_TILE_ROWS = 16  # query rows of one prefill program (triton/attention.PREFILL_BLOCK_M)


@dataclass(frozen=True)
class EngineCostModel:
    """``CostModel`` of pagedkv's engine on ``gpu`` (module docstring); ``cuda_graphs``: decode
    steps replay CUDA graphs (the engine's default on a GPU)."""

    model: ModelCost
    gpu: GPUSpec
    clock: EngineClock
    cuda_graphs: bool = True
    source: str = ""
    tp: int = 1  # tensor-parallel ranks (each on a GPU of ``gpu``)

    @property
    def _gemm_clock(self) -> gc.GPUClock:
        c = self.clock
        return gc.GPUClock(
            gemm_launch_s=c.gemm_launch_s,
            gemm_bw_eff=c.gemm_bw_eff,
            gemm_flops_eff=c.gemm_flops_eff,
            gemm_knee=c.gemm_knee,
        )

    def _element_bytes(self) -> int:
        """Bytes of one K (or V) value: from the model's KV record (a quantized KV reads fewer)."""
        md = self.model
        per_value = md.kv_record_bytes / max(1, 2 * md.num_layers * md.num_kv_heads * md.head_dim)
        return max(1, round(per_value))

    def decode_attention_s(
        self, num_seqs: int, context_tokens: float, block_size: int, longest_tokens: float = 0
    ) -> float:
        """One layer's paged decode kernel over ``num_seqs`` sequences of mean context
        ``context_tokens``, the longest ``longest_tokens`` (0: the mean)."""
        md, c = self.model, self.clock
        kv_heads = max(1, md.num_kv_heads // self.tp)  # a rank's (replicated: one)
        longest = max(1, round(max(context_tokens, longest_tokens)))
        splits = decode_splits(num_seqs, kv_heads, longest, self.gpu.num_sms)
        call = DecodeCall(
            num_seqs,
            context_tokens,
            block_size,
            splits,
            kv_heads,
            md.head_dim or 128,
            self._element_bytes(),
            longest,
        )
        return decode_call_s(c.decode_law, c.decode, self.gpu, call)

    def prefill_attention_s(self, shape: StepShape) -> float:
        """One layer's prefill kernel over the step: its chunks' query-key pairs and its decode
        rows' KV tokens, per query head."""
        c, heads = self.clock, max(1, self.model.num_query_heads // self.tp)
        b = max(1, shape.block_size)
        chunk_pairs = max(0, shape.attention_pairs - shape.decode_kv_tokens)
        work = shape.decode_kv_tokens * c.prefill_decode_token_s
        work += chunk_pairs / PREFILL_TILE_ROWS * c.prefill_pair_s
        ratio = token_cost_ratio(c.decode_law, c.decode, b, c.ref_block_size)
        return c.prefill_launch_s + heads * work * ratio / self.gpu.num_sms

    def gpu_s(self, shape: StepShape) -> float:
        """The step's GPU work (seconds of device time)."""
        md, c, g = self.model, self.clock, self.gpu
        m = shape.num_batched_tokens
        if m <= 0:
            return 0.0
        gemm_clock = self._gemm_clock
        if shape.num_seqs and shape.num_decode_seqs == shape.num_seqs:
            mean = shape.decode_kv_tokens / shape.num_seqs
            attention = self.decode_attention_s(
                shape.num_seqs, mean, max(1, shape.block_size), longest_context_tokens(shape)
            )
        else:
            attention = self.prefill_attention_s(shape)
        layer = layer_gemms_s(md, gemm_clock, g, m, self.tp) + c.gpu_per_token_s * m + attention
        h = md.hidden_size or 0
        layer += 2 * gc.all_reduce_s(g, gc.ACT_BYTES * m * h, self.tp)  # o_proj's, down_proj's
        sampled, vocab = max(1, shape.num_seqs), -(-md.vocab_size // self.tp)
        head = gc.gemm_s(gemm_clock, g, sampled, h, vocab) if h and md.vocab_size else 0.0
        return max(1, md.num_layers) * layer + head

    def host_s(self, shape: StepShape) -> float:
        """The step's host work (``EngineClock``'s fields). The block table's width is the
        longest sequence's blocks; a shape that does not know its longest context stands in
        its mean blocks (fewer: the table term is then low)."""
        c, n = self.clock, shape.num_seqs
        host = c.host_base_s + c.host_per_seq_s * n + c.host_per_token_s * shape.num_batched_tokens
        if c.host_per_table_entry_s and n:
            b = max(1, shape.block_size)
            longest = longest_context_tokens(shape)
            width = -(-longest // b) if longest else -(-shape.kv_blocks_read // n)
            host += c.host_per_table_entry_s * n * width
        return host

    def graphed(self, shape: StepShape) -> bool:
        """Whether the engine replays this step from a CUDA graph (decode rows only)."""
        return (
            self.cuda_graphs
            and self.tp == 1
            and shape.num_seqs > 0
            and shape.num_decode_seqs == shape.num_seqs == shape.num_batched_tokens
        )

    def step_time_s(self, shape: StepShape) -> float:
        c = self.clock
        gpu, host = self.gpu_s(shape), self.host_s(shape)
        if gpu <= 0:
            return max(host, 1e-9)
        if self.graphed(shape):
            return host + c.graph_replay_s + gpu
        launch = c.launch_per_layer_s * max(1, self.model.num_layers)
        return host + gc.soft_max(launch, gpu, c.overlap_p)
