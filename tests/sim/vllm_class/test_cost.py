"""A step priced op by op on a fitted clock (sim/vllm_class/cost.py), and the shape it prices."""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.pages.sources import load_shape
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.gpus import get_gpu
from pagedkv.sim.scenario_load import load_scenario
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.sim.vllm_class import clock as gc
from pagedkv.sim.vllm_class.cost import (
    PAGED_OVERHEAD_AT_16,
    FittedCostModel,
    block_walk_factor,
    fitted_cost_model,
    paged_overhead_at_16,
)

LLAMA = ModelCost.from_shape(load_shape("llama-3-8b"))
GPU = get_gpu("A100-80GB")
CLOCK = gc.GPUClock()


def test_step_shape_counts_a_mixed_batch_by_hand() -> None:
    # a decode of 1 after 100, a chunk of 30 after 10 cached, a fresh prompt of 5; B = 16
    shape = StepShape.of([(100, 1), (10, 30), (0, 5)], 16)
    assert shape.num_batched_tokens == 36 and shape.num_seqs == 3
    assert shape.kv_read_tokens == 101 + 40 + 5
    assert shape.attention_pairs == 100 + 1 + 30 * 10 + 30 * 31 // 2 + 15
    assert shape.kv_blocks_read == 7 + 3 + 1
    assert shape.num_decode_seqs == 1 and shape.decode_kv_tokens == 101


def test_model_cost_reads_the_matrices_of_the_shape() -> None:
    assert (LLAMA.hidden_size, LLAMA.intermediate_size, LLAMA.head_dim) == (4096, 14336, 128)
    assert (LLAMA.num_query_heads, LLAMA.num_kv_heads, LLAMA.vocab_size) == (32, 8, 128256)
    assert LLAMA.gated_mlp
    opt = ModelCost.from_shape(load_shape("opt-13b"))
    assert not opt.gated_mlp and opt.intermediate_size == 20480


def test_the_block_walk_factor_follows_the_papers_overhead() -> None:
    f = PAGED_OVERHEAD_AT_16  # the v0 kernel's, measured by the paper at B = 16
    fa = f * 0.25 / 1.5  # flash-attn: a sixth of v0's iteration latency (kernel_cost.KERNELS)
    assert paged_overhead_at_16("vllm") == pytest.approx(f)
    assert paged_overhead_at_16("flash-attn") == pytest.approx(fa)
    assert block_walk_factor(16) == pytest.approx(1.0)  # the measured kernel at its B
    assert block_walk_factor(1) == pytest.approx((1 + 16 * fa) / (1 + fa))
    assert block_walk_factor(64, "vllm") == pytest.approx((1 + f / 4) / (1 + fa))
    assert block_walk_factor(16, "contiguous") == pytest.approx(1 / (1 + fa))
    # at one-token pages FlashInfer's walk costs less than flash-attn's
    assert block_walk_factor(1, "flashinfer") < block_walk_factor(1, "flash-attn")


def test_a_decode_step_is_the_sum_of_its_ops() -> None:
    cost = FittedCostModel(LLAMA, GPU, CLOCK)
    shape = StepShape.of([(1023, 1)] * 8, 16)
    m, h = 8, 4096
    gemms = (
        gc.gemm_s(CLOCK, GPU, m, h, 48 * 128)
        + gc.gemm_s(CLOCK, GPU, m, 4096, h)
        + gc.gemm_s(CLOCK, GPU, m, h, 2 * 14336)
        + gc.gemm_s(CLOCK, GPU, m, 14336, h)
    )
    elem = sum(
        gc.elementwise_s(CLOCK, GPU, op, b)
        for op, b in (
            ("input_layernorm", 4 * m * h),
            ("post_attention_layernorm", 4 * m * h),
            ("attn_rope", 4 * m * 40 * 128),
            ("mlp_act", 6 * m * 14336),
            ("add", 6 * m * h),
        )
    )
    attn = gc.decode_attention_s(CLOCK, GPU, 8, 1024, 8, 128, 8 * 1024)
    head = gc.gemm_s(CLOCK, GPU, 8, h, 128256)
    emb = gc.elementwise_s(CLOCK, GPU, "emb", 4 * m * h)
    expected = 32 * (gemms + elem + attn) + head + emb + gc.step_overhead_s(CLOCK, 8)
    assert cost.step_time_s(shape) == pytest.approx(expected)


def test_tensor_parallelism_splits_the_matrices_and_adds_all_reduces() -> None:
    one = FittedCostModel(LLAMA, GPU, CLOCK, tp=1)
    two = FittedCostModel(LLAMA, GPU, CLOCK, tp=2)
    prompt = StepShape.of([(0, 4096)], 16)  # compute-bound: half the FLOPs per GPU
    assert two._gemms(4096) == pytest.approx(one._gemms(4096) / 2, rel=0.05)
    extra = 2 * 32 * gc.all_reduce_s(GPU, 2 * 4096 * 4096, 2)
    assert extra > 0
    assert two.step_time_s(prompt) < one.step_time_s(prompt)
    with pytest.raises(UsageError, match="tensor parallelism"):
        FittedCostModel(LLAMA, GPU, CLOCK, tp=0)


def test_small_blocks_cost_decode_time_and_a_contiguous_kernel_less() -> None:
    decode = [(2047, 1)] * 64
    cost = {b: FittedCostModel(LLAMA, GPU, CLOCK).step_time_s(StepShape.of(decode, b))
            for b in (1, 2, 16, 256)}  # fmt: skip
    assert cost[1] > cost[2] > cost[16]
    contiguous = FittedCostModel(LLAMA, GPU, CLOCK, "contiguous")
    assert contiguous.step_time_s(StepShape.of(decode, 16)) < cost[16]


def test_a_model_without_its_widths_is_priced_from_its_parameter_count() -> None:
    bare = ModelCost("m", 2 * 10**9, 10**9, 4096, 4 * 4 * 512, num_layers=4,
                     num_query_heads=8, num_kv_heads=8)  # fmt: skip
    cost = FittedCostModel(bare, GPU, CLOCK)
    params = 10**9 / 4
    k = int(params**0.5)
    assert cost._gemms(1) == pytest.approx(gc.gemm_s(CLOCK, GPU, 1, k, int(params / k)))
    assert cost.step_time_s(StepShape.of([(10, 1)], 16)) > 0


def test_simulate_prices_with_the_shipped_clock_and_tp() -> None:
    base = dict(synthetic="requests=20,prompt=200-400,output=20-40,rate=inf", max_model_len=2048)
    one = load_scenario(SimulateConfig(**base))
    assert "fitted GPU clock" in one.clock() and "A100-80GB.json" in one.clock()
    tp2 = load_scenario(SimulateConfig(**base, tensor_parallel=2))
    assert tp2.pools_slots[0] > 2 * one.pools_slots[0]  # half the weights per GPU, twice the GPUs
    assert "TP 2" in tp2.clock()
    with pytest.raises(UsageError, match="--tensor-parallel-size"):
        SimulateConfig(**base, tensor_parallel=2, cost="kernel")
    with pytest.raises(UsageError, match="--clock"):
        SimulateConfig(**base, clock="x.json", cost="roofline")


def test_the_helper_builds_the_named_model_gpu_and_kernel() -> None:
    cost = fitted_cost_model("opt-13b", "A100-40GB", backend="vllm")
    assert cost.gpu.name == "A100-40GB" and cost.backend == "vllm" and cost.paged
    assert "borrowed" in cost.source  # the 40 GB card borrows the 80 GB card's fit
