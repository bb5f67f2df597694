"""Swap preemption in the simulator: links, hand-computed transfer times, swap vs recompute."""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import Comparison, LinearCostModel, Simulation
from pagedkv.sim.links import LINKS, Link, get_link, host_link_for_gpu
from pagedkv.traces import TraceRequest


def test_a_transfer_costs_its_fixed_cost_plus_bytes_over_bandwidth() -> None:
    link = Link("test", bandwidth_bytes_per_s=1e9, per_transfer_s=1e-3)
    # 3 blocks of 1,000 bytes: 3 x 1 ms + 3,000 B / 1 GB/s = 3 ms + 3 us.
    assert link.transfer_time_s(3, 1000) == pytest.approx(0.003003)
    # Per-layer K and V tensors (2 x 40 layers): 240 transfers, the same bytes.
    assert link.transfer_time_s(3, 1000, transfers_per_block=80) == pytest.approx(0.240003)
    with pytest.raises(UsageError, match="bandwidth must be > 0"):
        Link("bad", 0, 1e-6)


def test_link_presets_and_the_host_link_of_each_gpu() -> None:
    # 16 lanes x 16 GT/s x 128/130 / 8 bits = 31.5 GB/s raw, 80 % of it effective.
    assert get_link("pcie4-x16").bandwidth_bytes_per_s == pytest.approx(31.5077e9 * 0.8, rel=1e-4)
    assert get_link("PCIe5-x16").bandwidth_bytes_per_s == pytest.approx(63.0154e9 * 0.8, rel=1e-4)
    assert all(link.per_transfer_s == pytest.approx(10e-6) for link in LINKS.values())
    assert host_link_for_gpu("A100-40GB").name == "pcie4-x16"
    assert host_link_for_gpu("A100-80GB").name == "pcie4-x16"
    assert host_link_for_gpu("H100-80GB").name == "pcie5-x16"
    assert host_link_for_gpu("H200-141GB").name == "pcie5-x16"
    assert host_link_for_gpu("L4").name == "pcie4-x16"
    unknown = host_link_for_gpu("MI300X")
    assert unknown.name == "pcie4-x16" and "unknown" in unknown.source
    with pytest.raises(UsageError, match="unknown link 'nvlink'"):
        get_link("nvlink")


def _requests() -> list[TraceRequest]:
    # Eight requests at once, distinct prompts of 20..48 tokens, 24 output tokens each: a pool
    # of 128 slots cannot hold them all as they grow, so someone is preempted.
    return [TraceRequest(0.0, ((100 + i, 20 + 4 * i),), 24) for i in range(8)]


RECORD_BYTES = 1000
LINK = Link("test", bandwidth_bytes_per_s=1e6, per_transfer_s=0.002)


def _run(config: SchedulerConfig, num_slots: int = 128, transfers_per_block: int = 1):
    return Simulation(
        _requests(),
        get_policy("paged:4"),
        num_slots,
        config,
        LinearCostModel(per_step_s=0.01),
        check_invariants=True,
        link=LINK,
        kv_record_bytes=RECORD_BYTES,
        transfers_per_block=transfers_per_block,
    ).run()


def test_swap_steps_last_their_transfers_and_tokens_match_an_unpreempted_run() -> None:
    swap_config = SchedulerConfig(
        max_model_len=256, preemption_mode="swap", swap_space_slots=4096, max_num_batched_tokens=64
    )
    swap = _run(swap_config)
    roomy = _run(SchedulerConfig(max_model_len=256, max_num_batched_tokens=64), 100_000)
    assert roomy.preemptions == 0
    assert swap.swap_outs > 0 and swap.swap_ins == swap.swap_outs and swap.swap_fallbacks == 0
    assert swap.preemptions == swap.swap_outs and swap.recomputed_tokens == 0
    # Hand-computed: each moved block is one transfer of 4 tokens x 1,000 B over 1 MB/s
    # (4 ms) plus 2 ms; every step costs 10 ms and nothing idles (all arrive at 0).
    moved = swap.swapped_blocks_out + swap.swapped_blocks_in
    assert swap.swap_time_s == pytest.approx(moved * (0.002 + 4 * 1000 / 1e6))
    assert swap.duration_s == pytest.approx(0.01 * swap.num_steps + swap.swap_time_s)
    # Per-layer K/V tensors (say 2 x 3 layers): 6 fixed costs a block, the same bytes.
    per_layer = _run(swap_config, transfers_per_block=6)
    assert per_layer.swapped_blocks_out == swap.swapped_blocks_out  # same schedule
    assert per_layer.swap_time_s == pytest.approx(moved * (6 * 0.002 + 4 * 1000 / 1e6))
    # The same token counts reach the same requests as without any preemption.
    assert [r.num_output_tokens for r in swap.records] == [24] * 8
    assert [r.num_output_tokens for r in swap.records] == [
        r.num_output_tokens for r in roomy.records
    ]


def test_recompute_moves_nothing_and_swap_needs_a_link() -> None:
    recompute = _run(SchedulerConfig(max_model_len=256, max_num_batched_tokens=64))
    assert recompute.preemptions > 0 and recompute.recomputed_tokens > 0
    assert (recompute.swap_outs, recompute.swap_time_s) == (0, 0.0)
    config = SchedulerConfig(max_model_len=256, preemption_mode="swap", swap_space_slots=64)
    with pytest.raises(UsageError, match="needs a host link and kv_record_bytes"):
        Simulation(_requests(), get_policy("vllm"), 128, config, LinearCostModel(0.01))


def test_comparison_passes_the_link_on() -> None:
    config = SchedulerConfig(
        max_model_len=256,
        preemption_mode="swap",
        swap_space_slots=4096,
        max_num_batched_tokens=64,
    )
    comparison = Comparison(
        _requests(),
        128,
        config,
        LinearCostModel(0.01),
        link=LINK,
        kv_record_bytes=RECORD_BYTES,
        check_invariants=True,
    )
    ((result, _),) = comparison.run([get_policy("paged:4")])
    assert result.swap_outs > 0 and result.swap_time_s > 0


def test_preemption_experiment_counts_the_articles_transfers_and_runs_quick(tmp_path) -> None:
    from pagedkv.sim.experiments import preemption

    result = preemption.run(quick=True, workers=1, progress=None)
    ex = {p["block_size"]: p for p in result["article_example"]["points"]}
    # The article: 1 GiB at 4 KiB/token is 262,144 tokens; one transfer per block.
    assert result["article_example"]["tokens"] == 262_144
    assert [ex[b]["transfers"] for b in (128, 16, 8)] == [2_048, 16_384, 32_768]
    link = get_link("pcie4-x16")  # the A100's host link
    assert ex[16]["swap_s"] == pytest.approx(16_384 * 10e-6 + 2**30 / link.bandwidth_bytes_per_s)
    opt = result["opt13b"]
    assert opt["record_bytes"] == 819_200 and opt["tokens"] == 1_310  # 2 x 40 x 5120 x 2 B
    assert opt["transfers_per_block_per_layer"] == 80
    swap_one = [p["swap_s_one_transfer_per_block"] for p in opt["points"]]
    swap_layers = [p["swap_s_per_layer_transfers"] for p in opt["points"]]
    # Falls as B grows, up to 128 (at 256, 6 whole blocks carry 1,536 slots for 1,310 tokens).
    assert swap_layers[:-1] == sorted(swap_layers[:-1], reverse=True)
    assert all(a < b for a, b in zip(swap_one, swap_layers, strict=True))
    recompute = [p["recompute_s"] for p in opt["points"]]
    assert max(recompute) <= 1.1 * min(recompute)  # (nearly) flat in B
    rows = result["end_to_end"]
    assert len(rows) == 3 * len(preemption.QUICK_BLOCK_SIZES)
    for row in rows:
        assert row["num_finished"] + row["num_refused"] == result["workload"]["requests"]
        if row["mode"] == "recompute":
            assert row["swap_outs"] == 0 and row["swap_time_s"] == 0
        else:
            assert row["recomputed_tokens"] == 0 or row["swap_fallbacks"] > 0
    assert any(r["preemptions"] for r in rows), "the chosen rate must preempt"
    png = tmp_path / "preemption.png"
    preemption.plot(result, png)
    assert png.stat().st_size > 10_000


def test_a_swap_space_below_one_block_of_the_policy_is_a_usage_error() -> None:
    config = SchedulerConfig(max_model_len=256, preemption_mode="swap", swap_space_slots=8)
    with pytest.raises(UsageError, match="paged:16: swap_space_slots=8 holds no whole KV block"):
        Simulation(
            _requests(),
            get_policy("paged:16"),
            128,
            config,
            LinearCostModel(0.01),
            link=LINK,
            kv_record_bytes=RECORD_BYTES,
        )
