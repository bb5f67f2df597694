"""The block-size-aware step cost: hand-computed block walks, the roofline as its limit."""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.pages.layout import load_layout
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cost_model import ModelCost, RooflineCostModel
from pagedkv.sim.costs.kernel import KernelCostModel
from pagedkv.sim.gpus import GPUSpec, get_gpu

# 2 layers x 4 query heads (2 KV heads); 1,000 KV bytes per token; round GPU numbers.
MODEL = ModelCost(
    "m", 10**9, 5 * 10**8, 1000, 1000, num_layers=2, num_query_heads=4, num_kv_heads=2
)
GPU = GPUSpec("g", 10**10, 1e12, 1e15, "test", num_sms=10)


def decode(num_seqs: int, context: int, block_size: int) -> StepShape:
    """``num_seqs`` sequences each decoding one token after ``context - 1`` cached ones."""
    blocks = num_seqs * -(-context // block_size)
    return StepShape(num_seqs, num_seqs * context, num_seqs * context, num_seqs, num_seqs,
                     blocks, block_size)  # fmt: skip


def test_small_blocks_pay_the_walk_by_hand() -> None:
    cost = KernelCostModel(MODEL, GPU, "vllm", step_overhead_s=0.002)
    # vllm: 1.5 us per iteration, 8 warps x 10 SMs = 80 at once; a block is walked by
    # 2 layers x 4 query heads = 8 iterations -> 8 * 1.5e-6 / 80 = 1.5e-7 s per block
    assert cost.per_block_s == pytest.approx(1.5e-7)
    # 10 sequences of 100 tokens at B=16: ceil(100/16) = 7 blocks each, 70 in all.
    # walk 70 * 1.5e-7 = 1.05e-5 s > bytes 70 * 16 * 1000 / 1e12 = 1.12e-6 s
    shape = decode(10, 100, 16)
    assert cost.attention_s(shape) == pytest.approx(1.05e-5)
    # weights + 10 new records over 1e12 B/s = 1.00001e-3 s (> 2 * 5e8 * 10 / 1e15 = 1e-5)
    assert cost.step_time_s(shape) == pytest.approx(0.002 + 1.00001e-3 + 1.05e-5)


def test_big_blocks_read_the_whole_tail_by_hand() -> None:
    cost = KernelCostModel(MODEL, GPU, "vllm", step_overhead_s=0.0)
    # B=256: 1 block per 100-token sequence, read whole: 10 * 256 * 1000 / 1e12 = 2.56e-6 s
    # (walk 10 * 1.5e-7 = 1.5e-6 s is hidden under it)
    assert cost.attention_s(decode(10, 100, 256)) == pytest.approx(2.56e-6)
    # the same tokens at B=100 fit exactly: 1e-6 s, and the walk (1.5e-6 s) now bounds it
    assert cost.attention_s(decode(10, 100, 100)) == pytest.approx(1.5e-6)


def test_backends_walk_per_query_or_kv_head() -> None:
    # trtllm-mha walks per KV head (2 x 2 = 4 iterations), 0.5 us, 16 warps x 10 SMs
    assert KernelCostModel(MODEL, GPU, "trtllm-mha").per_block_s == pytest.approx(4 * 0.5e-6 / 160)


def test_saturating_block_size() -> None:
    # walk per block 1.5e-7 s = bytes of 150 tokens (1000 B each at 1e12 B/s)
    assert KernelCostModel(MODEL, GPU).saturating_block_size == pytest.approx(150)


def test_converges_to_the_roofline_for_big_blocks_and_long_contexts() -> None:
    model = ModelCost.from_layout(load_layout("opt-13b"))
    gpu = get_gpu("A100-40GB")
    kernel = KernelCostModel(model, gpu, "vllm", 0.002)
    roofline = RooflineCostModel(model, gpu, 0.002)
    ratios = {}
    for b in (1, 16, 256):
        shape = decode(8, 2**20 + 1, b)  # a one-token tail block: read whole, but negligible
        ratios[b] = kernel.step_time_s(shape) / roofline.step_time_s(shape)
    assert ratios[256] == pytest.approx(1.0, abs=1e-3)
    assert ratios[16] == pytest.approx(1.0, abs=1e-3)  # above the saturating block size
    # B=1: one iteration per token; the walk (5.3x the bytes' time) bounds attention
    assert ratios[1] > 2


def test_opt13b_model_cost_knows_its_grid() -> None:
    m = ModelCost.from_layout(load_layout("opt-13b"))
    assert (m.num_layers, m.num_query_heads, m.num_kv_heads) == (40, 40, 40)
    assert m.kv_record_bytes == 2 * 40 * 5120 * 2  # K and V, 40 layers, 5120 wide, fp16
    assert m.weight_bytes == 2 * 12_853_473_280


def test_bad_backend_and_overhead_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown attention kernel 'cuda9'"):
        KernelCostModel(MODEL, GPU, "cuda9")
    with pytest.raises(UsageError, match="step overhead"):
        KernelCostModel(MODEL, GPU, "vllm", -1.0)


def test_contiguous_kernel_is_the_roofline_when_everything_is_memory_bound() -> None:
    model = ModelCost.from_layout(load_layout("opt-13b"))
    gpu = get_gpu("A100-40GB")
    contiguous = KernelCostModel(model, gpu, "contiguous", 0.002)
    roofline = RooflineCostModel(model, gpu, 0.002)
    # reserved regions: block_size = max_model_len, one "block" per sequence, yet only the
    # context is read (the reservation's unused slots are not)
    shape = StepShape(16, 16 * 300, 16 * 300, 16, 16, 16, 2048)
    assert contiguous.step_time_s(shape) == pytest.approx(roofline.step_time_s(shape))


def test_each_policy_has_its_frameworks_kernel() -> None:
    from pagedkv.sim.costs.kernel import kernel_for_policy

    names = ["vllm@32", "sglang", "radix:4", "trtllm", "paged-nocache:8", "reserved", "llamacpp"]
    assert [kernel_for_policy(n) for n in names] == [
        "flash-attn", "flashinfer", "flashinfer", "trtllm-mha", "flash-attn", "contiguous",
        "contiguous",
    ]  # fmt: skip
