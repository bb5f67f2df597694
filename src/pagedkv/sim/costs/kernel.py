"""A step cost that knows the block size: the roofline plus the attention kernel's block walk.

A paged attention kernel walks each sequence's block table: ``ceil(L / B)`` blocks for a context
of ``L`` tokens, the partly used tail block read whole. One block of one walking head and layer
is one *iteration* of a warp: read the physical block id from the table, form the block's
address, load its K (and V), reduce. Those steps depend on each other, so an iteration costs a
fixed latency ``iteration_latency_s`` however few tokens the block holds, and the GPU overlaps
only as many iterations as it keeps warps resident (``warps_per_sm * gpu.num_sms``). Hence,
for one step (Little's law over the block walk)::

    walks      = kv_blocks_read * num_layers * walking heads      (query or KV heads, per kernel)
    issue_s    = walks * iteration_latency_s / (warps_per_sm * num_sms)
    attn_mem_s = kv_blocks_read * B * kv_record_bytes / bandwidth  (whole blocks)
    attn_s     = max(attn_mem_s, attention FLOPs / peak, issue_s)
    step_s     = step_overhead_s + max(weights + new KV bytes / bandwidth, 2 * params * tokens /
                 peak) + attn_s

Too small a block carries too few bytes per iteration to keep the memory system busy
(``issue_s`` > ``attn_mem_s`` below ``saturating_block_size``): the kernel's parallelism starves.
Too big a block reads (and holds) unused tail slots. For large blocks and long contexts
``issue_s`` vanishes and the tail is negligible, and when both parts are memory-bound (decode)
the step equals ``RooflineCostModel``'s: the roofline is the limit this model tends to. (The
roofline takes one max over all bytes and FLOPs; here the GEMMs and the attention kernel run
one after the other, so a compute-bound prefill plus memory-bound attention costs their sum.)

The per-backend numbers in ``KERNELS`` are **assumptions** from each kernel's structure, not
measurements: see ``docs/simulate.md``. ``pagedkv simulate --cost-profile`` replaces all of this
with a fitted profile of a real engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.gpus import GPUSpec


@dataclass(frozen=True)
class KernelSpec:
    """An attention backend's block walk. ``iteration_latency_s``: one warp's dependent chain
    per block (table lookup, address, K/V load, reduction); ``warps_per_sm``: warps of this
    kernel an SM keeps resident; ``per_query_head``: the grid walks once per query head (vLLM
    v0: one thread block per (sequence, query head)) rather than once per KV head.
    ``paged=False``: a contiguous kernel (no table, reads only the context's tokens)."""

    backend: str
    iteration_latency_s: float
    warps_per_sm: int
    per_query_head: bool
    source: str
    paged: bool = True

    def __post_init__(self) -> None:
        if not self.iteration_latency_s >= 0 or self.warps_per_sm < 1:
            raise ValueError(f"kernel {self.backend!r}: latency >= 0 and warps_per_sm >= 1")


_DRAM = "an A100/H100 dependent global load takes ~0.5 us (L2 miss)"
KERNELS: dict[str, KernelSpec] = {
    k.backend: k
    for k in (
        # The paper's kernel (vLLM v0 csrc/attention paged_attention_v1): 4 warps per thread
        # block, each warp walks every 4th block; two dependent loads per iteration (block id,
        # then K) plus the shuffle reduction; a shared-memory logits buffer of the whole
        # context keeps ~2 thread blocks (8 warps) resident per SM (assumed).
        KernelSpec("vllm", 1.5e-6, 8, True, f"vLLM v0 PagedAttention structure; {_DRAM}"),
        # vLLM today (v1, FlashAttention-2/3 with a block table): one CTA per (sequence, KV
        # head), page ids of a 128-token tile gathered up front and loads pipelined: the
        # per-page cost is address issue, ~0.25 us of a warp (assumed), 16 warps/SM.
        KernelSpec("flash-attn", 0.25e-6, 16, False, "FlashAttention paged-KV structure"),
        # TRT-LLM XQA/MMHA: one CTA per KV head group, block ids prefetched, so one load
        # latency per page (assumed 0.5 us) and higher residency (16 warps/SM, assumed).
        KernelSpec("trtllm-mha", 0.5e-6, 16, False, f"TRT-LLM XQA structure; {_DRAM}"),
        # FlashInfer (SGLang's default, page 1): page indices staged in shared memory and rows
        # gathered with pipelined cp.async: the per-page cost is issue, not latency (assumed).
        KernelSpec("flashinfer", 0.1e-6, 16, False, "FlashInfer paged decode structure"),
        KernelSpec("fa4", 0.5e-6, 16, False, f"FlashAttention 4, 128-token pages; {_DRAM}"),
        KernelSpec("flashmla", 0.5e-6, 16, False, f"FlashMLA, 64-token pages; {_DRAM}"),
        # pagedkv's own torch path gathers whole blocks (all heads at once) per layer with
        # vectorized index ops: a small per-block cost, walked once per layer.
        KernelSpec("torch-sdpa", 0.05e-6, 32, False, "pagedkv gather + SDPA (vectorized)"),
        # One contiguous region per sequence (the reserved baseline, llama.cpp's cells): no
        # block table to walk, only the context's tokens are read: the roofline's attention.
        KernelSpec("contiguous", 0.0, 32, False, "contiguous KV, no block table", paged=False),
    )
}


# Which kernel each framework policy runs (``kernel_for_policy``); KIND:B policies by kind.
# vLLM policies run today's vLLM kernel (flash-attn); `--kernel vllm` is the paper's v0 one.
_POLICY_KERNELS = {
    "vllm": "flash-attn",
    "paged": "flash-attn",
    "paged-nocache": "flash-attn",
    "sglang": "flashinfer",
    "radix": "flashinfer",
    "radix-nocache": "flashinfer",
    "trtllm": "trtllm-mha",
    "deepinfer": "flashmla",  # an MLA model's engine with a fixed-page kernel
    "llamacpp": "contiguous",  # flat KV cells, masked: no block table
    "reserved": "contiguous",
}


def kernel_for_policy(policy_name: str) -> str:
    """The attention kernel a framework policy runs: ``vllm@32`` -> ``flash-attn``, ``sglang``
    -> ``flashinfer``, ``paged:8`` -> ``flash-attn``, ``reserved`` -> ``contiguous``; a name
    not listed -> ``flash-attn``."""
    base = policy_name.split("@")[0].split(":")[0]
    return _POLICY_KERNELS.get(base, "flash-attn")


def get_kernel(name: str) -> KernelSpec:
    """The kernel spec of backend ``name``; UsageError naming the known ones."""
    if name not in KERNELS:
        raise UsageError(f"unknown attention kernel {name!r} (known: {', '.join(KERNELS)})")
    return KERNELS[name]


@dataclass(frozen=True)
class KernelCostModel:
    """The block-size-aware step cost (module docstring). ``backend`` names a ``KERNELS``
    entry; UsageError for an unknown one or a negative overhead."""

    model: ModelCost
    gpu: GPUSpec
    backend: str = "vllm"
    step_overhead_s: float = 0.002

    def __post_init__(self) -> None:
        get_kernel(self.backend)
        if not self.step_overhead_s >= 0:
            raise UsageError(f"step overhead must be >= 0, got {self.step_overhead_s}")

    @property
    def kernel(self) -> KernelSpec:
        return get_kernel(self.backend)

    @property
    def walks_per_block(self) -> int:
        """Iterations one block costs: layers x walking heads (1 each when unknown)."""
        m = self.model
        heads = m.num_query_heads if self.kernel.per_query_head else m.num_kv_heads
        return max(1, m.num_layers) * max(1, heads)

    @property
    def per_block_s(self) -> float:
        """GPU time one block of one sequence adds to a step's walk (all layers and heads)."""
        k = self.kernel
        concurrency = k.warps_per_sm * self.gpu.num_sms
        return self.walks_per_block * k.iteration_latency_s / concurrency

    @property
    def saturating_block_size(self) -> float:
        """The block size at which a block's bytes take as long to read as its walk costs:
        below it the walk, not memory bandwidth, bounds attention."""
        bytes_s = self.model.kv_record_bytes / self.gpu.mem_bandwidth_bytes_per_s
        return self.per_block_s / bytes_s

    def attention_s(self, shape: StepShape) -> float:
        """The attention kernel's part of a step (see the module docstring)."""
        m, gpu = self.model, self.gpu
        if not self.kernel.paged:
            memory_s = shape.kv_read_tokens * m.kv_record_bytes / gpu.mem_bandwidth_bytes_per_s
            flops_s = m.attention_flops_per_pair * shape.attention_pairs / gpu.peak_flops_per_s
            return max(memory_s, flops_s)
        blocks = shape.kv_blocks_read
        if blocks == 0 and shape.kv_read_tokens:  # a caller that does not know the walk
            blocks = -(-shape.kv_read_tokens // max(1, shape.block_size))
        memory_s = blocks * shape.block_size * m.kv_record_bytes / gpu.mem_bandwidth_bytes_per_s
        flops_s = m.attention_flops_per_pair * shape.attention_pairs / gpu.peak_flops_per_s
        return max(memory_s, flops_s, blocks * self.per_block_s)

    def step_time_s(self, shape: StepShape) -> float:
        m, gpu = self.model, self.gpu
        write_bytes = shape.num_batched_tokens * m.kv_record_bytes
        memory_s = (m.weight_bytes + write_bytes) / gpu.mem_bandwidth_bytes_per_s
        compute_s = 2 * m.num_params * shape.num_batched_tokens / gpu.peak_flops_per_s
        return self.step_overhead_s + max(memory_s, compute_s) + self.attention_s(shape)
