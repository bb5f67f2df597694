"""The multi-replica simulator: one replica is one engine, the router follows the caches the
events describe, balance spreads a hot prefix, and the index equals the replicas' caches."""

from __future__ import annotations

import pytest

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import LinearCostModel, Simulation
from pagedkv.sim.cluster import Cluster
from pagedkv.sim.cluster_summary import cluster_ideal_hits, summarize_cluster
from pagedkv.traces import TraceRequest, generate, parse_spec

CONFIG = SchedulerConfig(max_num_batched_tokens=256, max_model_len=1024)
COST = LinearCostModel(per_step_s=0.010, per_token_s=0.0001)


def req(t: float, segments: tuple[tuple[int, int], ...], output: int) -> TraceRequest:
    return TraceRequest(t, segments, output)


def cluster(requests, router: str, n: int = 2, slots: int = 4096, **kw) -> Cluster:
    return Cluster(
        requests, get_policy("paged:16"), slots, CONFIG, COST, n, router,
        check_invariants=True, **kw,
    )  # fmt: skip


def _fields(rec) -> tuple:
    return (
        rec.admitted_s, rec.first_token_s, rec.finish_s, rec.num_output_tokens,
        rec.prefix_hit_tokens, rec.refused,
    )  # fmt: skip


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "prefix-aware"])
def test_one_replica_is_exactly_one_engine(router: str) -> None:
    # A pool small enough to preempt and evict, shared prefixes, multi-turn, one refusal.
    spec = parse_spec("requests=40,prompt=100-700,output=5-60,system=200,turns=2,gap=0.2,rate=60")
    requests = [*generate(spec, 3), req(99.0, ((7, 5000),), 3)]  # longer than max_model_len
    sim = Simulation(requests, get_policy("paged:16"), 2048, CONFIG, COST, check_invariants=True)
    one = sim.run()
    got = cluster(requests, router, n=1, slots=2048).run()
    assert one.preemptions > 0 and one.records[-1].refused
    assert [_fields(r) for r in got.records] == [_fields(r) for r in one.records]
    rep = got.replicas[0]
    assert (rep.num_steps, rep.duration_s, rep.mean_running, rep.preemptions, rep.evictions) == (
        one.num_steps, one.duration_s, one.mean_running, one.preemptions, one.evictions,
    )  # fmt: skip
    assert rep.series.kv_utilization == one.series.kv_utilization
    assert got.load_imbalance == 1.0 and set(got.served_by) == {0}


# Two conversations A (segments 10, 11, 12) and B (20, 21, 22), blocks of 16 tokens: turn 1 is
# 64 tokens, turn 2 adds 32 (96), turn 3 adds 32 more (128). C is one unrelated request between
# the first and second turns. Every turn finishes long before the next arrives.
TWO_CONVERSATIONS = [
    req(0.000, ((10, 64),), 4),  # A1
    req(0.001, ((20, 64),), 4),  # B1
    req(0.500, ((30, 48),), 4),  # C
    req(1.000, ((10, 64), (11, 32)), 4),  # A2: A1's 64 prompt tokens are 4 cached blocks
    req(1.001, ((20, 64), (21, 32)), 4),  # B2
    req(2.000, ((10, 64), (11, 32), (12, 32)), 4),  # A3: A2's 96 tokens are 6 blocks
    req(2.001, ((20, 64), (21, 32), (22, 32)), 4),  # B3
]
A, B = (0, 3, 5), (1, 4, 6)


def test_prefix_aware_sends_every_follow_up_turn_to_its_conversation() -> None:
    got = cluster(TWO_CONVERSATIONS, "prefix-aware").run()
    assert len({got.served_by[i] for i in A}) == 1 and len({got.served_by[i] for i in B}) == 1
    assert got.served_by[0] != got.served_by[1]  # idle replicas: the least loaded in turn
    hits = [r.prefix_hit_tokens for r in got.records]
    assert hits == [0, 0, 0, 64, 64, 96, 96]  # 2 x (64 + 96) = the whole shared prefix
    assert got.decisions == {"no-prefix": 3, "prefix": 4}
    assert sum(hits) == cluster_ideal_hits(TWO_CONVERSATIONS, got) == 320


def test_round_robin_loses_the_conversations_after_an_odd_request() -> None:
    # Turns go r1, r0, r1 (C), r0 (A2: A1 is on r1), r1 (B2: B1 is on r0), r0, r1:
    # the second turns miss, the third turns find their second turns.
    got = cluster(TWO_CONVERSATIONS, "round-robin").run()
    assert got.served_by == [1, 0, 1, 0, 1, 0, 1]
    assert [r.prefix_hit_tokens for r in got.records] == [0, 0, 0, 0, 0, 96, 96]
    summary = summarize_cluster(got, cluster_ideal_hits(TWO_CONVERSATIONS, got))
    assert summary["prefix_hit_tokens"] == 192 and summary["prefix_hit_of_ideal"] == 0.6
    assert summary["routing_decisions"] == {"rotation": 7}
    assert [r["num_requests"] for r in summary["replicas"]] == [3, 4]


def _hot_prefix(num: int) -> list[TraceRequest]:
    """A warm-up request puts prefix 5 (64 tokens) on one replica; at t=1, ``num`` requests
    with that prefix arrive at once (each with its own 32-token suffix and 40 tokens out)."""
    hot = [req(1.0, ((5, 64), (100 + k, 32)), 40) for k in range(num)]
    return [req(0.0, ((5, 64),), 1), *hot]


def test_a_hot_prefix_under_overload_spreads_within_the_balance_band() -> None:
    got = cluster(_hot_prefix(12), "prefix-aware", balance_abs=2, balance_rel=0.0).run()
    holder = got.served_by[0]
    routed = [got.served_by[1:].count(r) for r in (0, 1)]
    # Every request sees the holder's prefix; once the holder is more than 2 requests ahead of
    # the other replica, load wins ("balance"): the holder ends 2 or 3 ahead (7 vs 5 here).
    assert routed[holder] - routed[1 - holder] in (2, 3) and sum(routed) == 12
    assert got.decisions["balance"] == routed[1 - holder]
    # Without a band every request piles onto the holder.
    piled = cluster(_hot_prefix(12), "prefix-aware", balance_abs=1000).run()
    assert piled.served_by[1:] == [piled.served_by[0]] * 12
    assert piled.decisions == {"no-prefix": 1, "prefix": 12}


def test_least_loaded_picks_the_idle_replica() -> None:
    # R0 runs 200 tokens (> 2 s of steps); R1 at 0.1 s and R2 at 0.2 s find r-R0 busy.
    requests = [req(0.0, ((1, 32),), 200), req(0.1, ((2, 32),), 200), req(0.2, ((3, 32),), 5)]
    got = cluster(requests, "least-loaded", n=3).run()
    assert len(set(got.served_by)) == 3  # each went to a replica with nothing running
    assert got.decisions == {"least-loaded": 3}
    rr = cluster(requests, "round-robin", n=2).run()
    assert rr.served_by[0] == rr.served_by[2]  # round-robin queues behind the long one


@pytest.mark.parametrize("policy", ["paged:16", "sglang", "radix:8"])
@pytest.mark.parametrize("router", ["round-robin", "prefix-aware"])
def test_index_equals_every_replicas_cache_after_every_step(policy: str, router: str) -> None:
    # check_invariants: after each step, scheduler invariants and index == prefix_hashes().
    # A small pool, so blocks are evicted (BlockRemoved) as well as stored.
    spec = parse_spec("requests=30,prompt=50-400,output=5-40,system=96,turns=3,gap=0.1,rate=80")
    requests = generate(spec, 1)
    got = Cluster(
        requests, get_policy(policy), 1024, CONFIG, COST, 3, router, check_invariants=True
    ).run()
    assert sum(r.evictions for r in got.replicas) > 0 and got.num_index_events > 0
    assert all(r.finish_s is not None for r in got.records if not r.refused)


def test_bad_values_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="replicas must be an integer >= 1"):
        cluster(TWO_CONVERSATIONS, "round-robin", n=0)
    with pytest.raises(UsageError, match="unknown routing policy 'random'"):
        cluster(TWO_CONVERSATIONS, "random")
