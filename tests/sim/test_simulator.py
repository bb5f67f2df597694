"""The simulator: hand-computed timings, determinism, and the issue's acceptance scenarios."""

from __future__ import annotations

import pytest

from pagedkv.kvcache.policies import get_policy
from pagedkv.pages.layout import load_layout
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import (
    Comparison,
    LinearCostModel,
    ModelCost,
    RooflineCostModel,
    Simulation,
    StepShape,
    expand_policies,
    get_gpu,
    kv_pool_bytes,
    summarize,
)
from pagedkv.traces import (
    TraceRequest,
    generate,
    load_trace,
    parse_spec,
    shared_trace,
    shared_traces_candidates,
)


def req(t: float, seg: int, prompt: int, output: int) -> TraceRequest:
    return TraceRequest(t, ((seg, prompt),), output)


def test_three_requests_with_a_linear_cost_give_hand_computed_ttfts() -> None:
    # Step time = 10 ms + 1 ms per scheduled token; a budget of 8 tokens per step.
    # step 1 (t=0):      R0 prefill chunk 8 of 10            -> 18 ms, t = .018
    # step 2 (t=.018):   R0 last 2 (+1st token), R1 4 (arrived at .005) -> 16 ms, t = .034
    #                    R0 TTFT .034; R1 TTFT .029 and done (1 token)
    # step 3 (t=.034):   R0 decode                           -> 11 ms, t = .045, R0 done
    # idle until R2 arrives at .050
    # step 4 (t=.050):   R2 prefill 3                        -> 13 ms, t = .063, TTFT .013
    # step 5 (t=.063):   R2 decode                           -> 11 ms, t = .074, R2 done
    requests = [req(0.0, 10, 10, 2), req(0.005, 20, 4, 1), req(0.05, 30, 3, 2)]
    sim = Simulation(
        requests,
        get_policy("paged:4"),
        num_kv_slots=400,
        config=SchedulerConfig(max_num_batched_tokens=8, max_model_len=64),
        cost=LinearCostModel(per_step_s=0.010, per_token_s=0.001),
        check_invariants=True,
    )
    result = sim.run()
    r0, r1, r2 = result.records
    assert [r.ttft_s for r in result.records] == pytest.approx([0.034, 0.029, 0.013])
    assert [r.e2e_s for r in result.records] == pytest.approx([0.045, 0.029, 0.024])
    assert r0.tpot_s == pytest.approx(0.011) and r1.tpot_s is None
    assert result.num_steps == 5 and result.duration_s == pytest.approx(0.074)
    assert result.peak_running == 2
    s = summarize(result)
    assert s["output_tokens"] == 5 and s["throughput_tokens_per_s"] == pytest.approx(
        5 / 0.074, abs=1e-3
    )
    assert s["ttft_p50_s"] == pytest.approx(0.029) and s["refused"] == 0


def test_roofline_step_time_by_hand() -> None:
    model = ModelCost("m", weight_bytes=10**9, num_params=5 * 10**8, kv_record_bytes=1000,
                      attention_flops_per_pair=100)  # fmt: skip
    gpu = get_gpu("L4")  # 300 GB/s, 121 TFLOP/s
    cost = RooflineCostModel(model, gpu, step_overhead_s=0.001)
    # Decode of 4 sequences at 1000 context tokens: memory bound.
    decode = StepShape(num_batched_tokens=4, kv_read_tokens=4000, attention_pairs=4000)
    assert cost.step_time_s(decode) == pytest.approx(0.001 + (10**9 + 4004 * 1000) / 300e9)
    # A 4096-token prefill: compute bound (2 * 5e8 * 4096 FLOPs + attention pairs).
    pairs = 4096 * 4097 // 2
    prefill = StepShape(4096, 4096, pairs)
    flops = 2 * 5 * 10**8 * 4096 + 100 * pairs
    assert cost.step_time_s(prefill) == pytest.approx(0.001 + flops / 121e12)


def test_model_cost_from_the_page_layout_and_pool_size() -> None:
    layout = load_layout("llama-3-8b", kv_dtype="fp16")
    model = ModelCost.from_layout(layout)
    assert model.kv_record_bytes == 128 * 1024  # the article's 128 KiB per token
    assert model.attention_flops_per_pair == 4 * 32 * 32 * 128
    pool = kv_pool_bytes(get_gpu("A100-80GB"), model.weight_bytes, 0.9, 4 * 2**30)
    assert pool == 72 * 10**9 - model.weight_bytes - 4 * 2**30
    with pytest.raises(ValueError, match="no KV pool"):
        kv_pool_bytes(get_gpu("L4"), model.weight_bytes, 0.9, 8 * 2**30)


def _article_runs(num_requests: int = 120):
    """The second article: an 8B model at FP16 (128 KiB/token), a 58 GiB pool, 32k max length,
    requests of about 6k tokens (prompt 2k-9k + output 200-800) all queued at once."""
    layout = load_layout("llama-3-8b", kv_dtype="fp16")
    requests = generate(parse_spec(f"requests={num_requests},prompt=2000-9000,output=200-800"))
    cost = RooflineCostModel(ModelCost.from_layout(layout), get_gpu("A100-80GB"))
    slots = 58 * 2**30 // layout.record_bytes
    comparison = Comparison(requests, slots, SchedulerConfig(max_model_len=32768), cost)
    return comparison.run(expand_policies(["reserved", "vllm"]))


def test_article_scenario_paged_runs_at_least_three_times_the_reserved_concurrency() -> None:
    (reserved, rs), (vllm, vs) = _article_runs()
    assert rs["peak_running"] == 14  # 58 GiB / (32768 tokens x 128 KiB) = 14.5 regions
    assert vs["peak_running"] >= 3 * rs["peak_running"]
    assert rs["reserved_unused_mean"] > 0.5 and vs["reserved_unused_mean"] == 0.0
    assert rs["num_finished"] == vs["num_finished"] == 120


def test_simulation_is_deterministic_for_a_seed() -> None:
    def run(seed: int) -> dict:
        spec = parse_spec("requests=40,prompt=50-400,output=5-60,rate=100,system=64,turns=2")
        cost = LinearCostModel(0.002, 1e-5)
        config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=2048)
        comparison = Comparison(generate(spec, seed), 1500, config, cost, check_invariants=True)
        ((_, s),) = comparison.run(expand_policies(["vllm"]))
        del s["wall_time_s"]  # real time, not part of the simulated result
        return s

    first = run(3)
    assert first == run(3) and first != run(4)
    assert first["preemptions"] > 0 and first["prefix_hit_tokens"] > 0


def _mooncake_hits(
    requests, slots: int, policy: str = "vllm", check: bool = False
) -> tuple[int, int]:
    cost = LinearCostModel(0.01, 1e-6)
    config = SchedulerConfig(max_num_seqs=64, max_model_len=131072)
    comparison = Comparison(requests, slots, config, cost, check_invariants=check)
    ((_, s),) = comparison.run(expand_policies([policy]))
    return s["prefix_hit_tokens"], s["ideal_prefix_hit_tokens"]


@pytest.mark.parametrize("policy", ["vllm", "sglang", "trtllm", "paged:7"])
def test_prefix_hits_equal_the_trace_with_a_large_pool_and_fall_as_it_shrinks(
    tmp_path, policy: str
) -> None:
    # A hand-built Mooncake-style trace: 6 conversations of 3 growing turns over shared ids.
    rows, next_id = [], 100
    for conv in range(6):
        ids = [0, 1] if conv % 2 else [0]  # a shared system prompt of 1 or 2 blocks
        for turn in range(3):
            ids = ids + list(range(next_id, next_id + 3))
            next_id += 3
            rows.append((conv * 50 + turn * 400, 512 * len(ids) - 100, 20, list(ids)))
    rows.sort(key=lambda r: r[0])
    path = tmp_path / "m.jsonl"
    from tests.traces.test_traces import write_mooncake

    requests = load_trace(write_mooncake(path, rows))
    big_hits, ideal = _mooncake_hits(requests, slots=60_000, policy=policy, check=True)
    assert big_hits == ideal > 0
    small_hits, _ = _mooncake_hits(requests, slots=9_000, policy=policy, check=True)
    assert small_hits < big_hits


def test_mooncake_replay_hits_what_the_hash_ids_allow() -> None:
    path = shared_trace("mooncake_conversation.jsonl")
    if path is None:
        places = ", ".join(map(str, shared_traces_candidates()))
        pytest.skip(f"Mooncake trace not found beside the repository ({places})")
    requests = load_trace(path, max_requests=150)
    hits, ideal = _mooncake_hits(requests, slots=4_000_000)
    assert hits == ideal and ideal > 0
    smaller, _ = _mooncake_hits(requests, slots=150_000)
    assert smaller < hits
