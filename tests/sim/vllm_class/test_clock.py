"""The clock's op prices against hand-computed values (sim/vllm_class/clock.py)."""

from __future__ import annotations

import math

import pytest

from pagedkv.sim.gpus import GPUS, GPUSpec, get_gpu
from pagedkv.sim.vllm_class import clock as gc

GPU = GPUSpec("g", 10**10, 1e12, 1e15, "test", num_sms=10, link_bytes_per_s=1e11)


def test_soft_max_is_the_sum_at_one_and_the_max_as_p_grows() -> None:
    assert gc.soft_max(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert gc.soft_max(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert gc.soft_max(3.0, 4.0, 200.0) == pytest.approx(4.0, rel=1e-3)
    assert gc.soft_max(0.0, 0.0, 2.0) == 0.0


def test_gemm_price_by_hand() -> None:
    clock = gc.GPUClock(gemm_launch_s=1e-6, gemm_bw_eff=0.5, gemm_flops_eff=0.25, gemm_knee=2.0)
    m, k, n = 10, 1000, 2000
    mem = 2 * (k * n + m * k + m * n) / (1e12 * 0.5)  # 8.06e-6 s
    comp = 2 * m * k * n / (1e15 * 0.25)  # 1.6e-7 s
    assert gc.gemm_s(clock, GPU, m, k, n) == pytest.approx(1e-6 + math.hypot(mem, comp))


def test_flash_decoding_split_rule_by_hand() -> None:
    # 4 CTAs on 216 slots, 16 KV tiles: the counts that shorten the parts are 1-6, 8 and 16
    # (9-15 leave 2 tiles a part, as 8 does); efficiency 4s/216 peaks at s = 16 (0.296) and
    # the fewest within 85 % of it (>= 0.252, s >= 13.6) is 16
    assert gc.fa_num_splits(4, 16, 216) == 16
    assert gc.fa_num_splits(4, 12, 216) == 12  # 1-6 and 12 shorten the parts; 12 is the best
    assert gc.fa_num_splits(200, 16, 216) == 1  # 200 >= 0.8 * 216: the GPU is full
    assert gc.fa_num_splits(4, 1, 216) == 1  # one tile: nothing to split
    # 64 CTAs: s = 3 fills 192 of 216 slots (0.889); s = 16 fills 1,024 of 1,080 (0.948),
    # the best of the counts that shorten the parts; the fewest within 85 % (>= 0.806): 3
    assert gc.fa_num_splits(64, 16, 216) == 3


def test_decode_attention_has_a_bandwidth_floor_and_a_split_cost() -> None:
    clock = gc.GPUClock(decode_launch_s=0, decode_split_s=5e-6, decode_per_seq_s=0,
                        decode_bw_eff=1.0, decode_tile_eff=1e9)  # fmt: skip
    # 1,000 sequences x 2 KV heads fill the GPU: no split, time = bytes / bandwidth
    t = gc.decode_attention_s(clock, GPU, 1000, 256, 2, 64)
    assert t == pytest.approx(1000 * 256 * 2 * (2 * 64 * 2) / 1e12)
    # one short sequence over many tiles splits: the combine kernel's cost is added
    one = gc.decode_attention_s(clock, GPU, 1, 4096, 2, 64)
    assert one == pytest.approx(5e-6 + 4096 * 2 * 256 / 1e12)


def test_prefill_walk_grows_with_the_chunk_and_the_cache() -> None:
    clock = gc.GPUClock(prefill_launch_s=0.0, prefill_split_s=0.0, prefill_tile_eff=1.0)
    small = gc.prefill_attention_s(clock, GPU, 1, 64, 0, 8, 64)
    # 64 queries, 8 heads: 8 CTAs, 1 KV tile of 128 -> no split, one wave, chain of 1 tile
    tile_s = 4 * 64 * 64 * 64 / (1e15 / 10)
    assert small == pytest.approx(tile_s)
    assert gc.prefill_attention_s(clock, GPU, 1, 64, 4096, 8, 64) > small
    assert gc.prefill_attention_s(clock, GPU, 1, 1024, 0, 8, 64) > small


def test_all_reduce_is_a_ring_over_the_link() -> None:
    assert gc.all_reduce_s(GPU, 1e6, 1) == 0.0
    expected = gc.ALL_REDUCE_LATENCY_S + 2 * 3 / 4 * 1e6 / (1e11 * gc.ALL_REDUCE_EFFICIENCY)
    assert gc.all_reduce_s(GPU, 1e6, 4) == pytest.approx(expected)


def test_step_overhead_grows_with_sequences_and_workers() -> None:
    clock = gc.GPUClock(step_base_s=1e-3, step_per_seq_s=1e-5, step_per_worker_s=2e-4)
    assert gc.step_overhead_s(clock, 64, 4) == pytest.approx(1e-3 + 64e-5 + 3 * 2e-4)


@pytest.mark.parametrize(
    "bad", [{"gemm_bw_eff": 0.0}, {"step_base_s": -1.0}, {"gemm_knee": math.nan}]
)
def test_a_bad_clock_parameter_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="clock parameter"):
        gc.GPUClock(**bad)


@pytest.mark.parametrize("bad", [(-1e-6, 0.5), (1e-6, 0.0), (1e-6, math.inf)])
def test_a_bad_elementwise_price_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="clock parameter"):
        gc.KernelPrice(*bad)


def test_presets_cover_the_gpus_users_have_and_aliases_resolve() -> None:
    for name in ("A10", "A40", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB",
                 "H100-PCIe", "H200-141GB", "B200"):  # fmt: skip
        assert name in GPUS and GPUS[name].source
    assert get_gpu("a100").name == "A100-80GB"  # Vidur's folder name
    assert get_gpu("h100").name == "H100-80GB"
    assert get_gpu("H100-SXM") is GPUS["H100-80GB"]
