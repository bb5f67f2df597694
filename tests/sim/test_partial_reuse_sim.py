"""Partial-block reuse in the simulator: the copy priced on the clock (hand-computed), the
shorter prefill it buys, the policy sweep over units, and the per-run counters."""

from __future__ import annotations

import pytest

from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import Comparison, LinearCostModel, Simulation
from pagedkv.sim.compare import expand_policies
from pagedkv.sim.links import DeviceCopy, Link, device_copy
from pagedkv.traces import TraceRequest

RECORD_BYTES = 1000
CONFIG = SchedulerConfig(max_num_seqs=8, max_model_len=256)
COST = LinearCostModel(0.01, 0.001)  # 10 ms a step + 1 ms a token
COPY = DeviceCopy(Link("test memory", 1e9, 1e-6), launches=2)
# A: 13 tokens of segment 1, then 7 of its own; B, 10 s later: the same 13, then 5 of its own.
REQUESTS = [
    TraceRequest(0.0, ((1, 13), (2, 7)), 3),
    TraceRequest(10.0, ((1, 13), (3, 5)), 1),
]


def _run(policy):
    sim = Simulation(
        REQUESTS, policy, 256, CONFIG, COST, kv_record_bytes=RECORD_BYTES, device_copy=COPY
    )
    return sim.run()


def test_the_copy_is_priced_and_the_prefill_it_saves_is_not():
    """B = 8: whole blocks reuse 8 of B's 13 shared tokens; U = 1 all 13, the 5 in its second
    block copied (A's second block has A's kept tail after it: no leaf, so a copy)."""
    whole = _run(get_policy("paged:8"))
    partial = _run(get_policy("paged:8").with_prefix_match_unit(1))
    b_whole, b_partial = whole.records[1], partial.records[1]
    assert (b_whole.prefix_hit_tokens, b_partial.prefix_hit_tokens) == (8, 13)
    # B's first step: 10 ms + 1 ms a computed token (18 - 8 = 10 or 18 - 13 = 5) ...
    assert b_whole.ttft_s == pytest.approx(0.01 + 0.010)
    # ... plus, with U = 1, the copy: 2 launches x 1 us + 5 tokens x 1,000 B / 1 GB/s.
    copy_s = 2e-6 + 5 * RECORD_BYTES / 1e9
    assert b_partial.ttft_s == pytest.approx(0.01 + 0.005 + copy_s)
    assert partial.prefix_copy_bytes == 5 * RECORD_BYTES
    assert partial.prefix_copy_time_s == pytest.approx(copy_s)
    assert (partial.partial_hits, partial.partial_hit_tokens, partial.partial_claims) == (1, 5, 0)
    assert (whole.partial_hits, whole.prefix_copy_time_s) == (0, 0.0)


def test_the_sweep_runs_each_unit_and_summarizes_the_partial_counters():
    policies = expand_policies(["vllm", "reserved"], [8], [None, 1])
    assert [p.name for p in policies] == ["vllm@8+u8", "vllm@8+u1", "reserved"]
    comparison = Comparison(
        REQUESTS,
        256,
        CONFIG,
        COST,
        check_invariants=True,
        kv_record_bytes=RECORD_BYTES,
        device_copy=COPY,
    )
    runs = comparison.run(policies)
    summaries = {s["policy"]: s for _, s in runs}
    assert "partial_hits" not in summaries["vllm@8+u8"]  # U = B: the summary of before
    s = summaries["vllm@8+u1"]
    assert (s["prefix_match_unit"], s["partial_hits"], s["prefix_copy_bytes"]) == (1, 1, 5000)
    assert s["prefix_hit_tokens"] == 13 and s["ideal_prefix_hit_tokens"] == 13
    assert summaries["vllm@8+u8"]["ideal_prefix_hit_tokens"] == 8
    with pytest.raises(ValueError, match="radix allocator matches whole pages"):
        expand_policies(["radix:8"], (), [1])


def test_the_device_copy_of_a_gpu():
    copy = device_copy("H100", 3.35e12, num_layers=32)
    assert copy.launches == 64
    # 64 launches x 5 us, then 1 MB at 80 % of 3.35 TB/s, each byte read and written.
    assert copy.time_s(10**6) == pytest.approx(64 * 5e-6 + 1e6 / (3.35e12 * 0.8 / 2))
