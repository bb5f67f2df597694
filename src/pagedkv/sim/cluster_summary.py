"""One flat JSON-ready dict per cluster run (``summarize_cluster``), like ``summarize`` for one
engine, with the routing numbers added.

The cluster's totals have ``summarize``'s fields over every request (``num_kv_slots`` is one
replica's pool; ``mean_running`` and the step, preemption and eviction counts are sums over
replicas, ``peak_running`` the largest replica's; the pool shares are means over replicas),
and:

* ``router``, ``num_replicas``, ``balance_abs`` / ``balance_rel`` (prefix-aware's band);
* ``prefix_hit_of_ideal``: prefix-hit tokens / ``ideal_prefix_hit_tokens``, the hit ceiling
  of one engine with an infinite cache holding every prefix;
* ``load_imbalance``: max over replicas of time-mean running / mean over replicas of it;
* ``routing_decisions``: reason -> count (``pagedkv.routing.RouteDecision.reason``);
* ``index_events``: KV events the router's prefix index applied;
* ``replicas``: per replica ``replica``, ``num_requests`` (routed to it), ``num_finished``,
  ``prefix_hit_tokens``, ``ttft_p50_s``, ``ttft_p99_s``, ``throughput_tokens_per_s``,
  ``mean_running``, ``peak_running``, ``preemptions``, ``evictions``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.sim.cluster import ClusterResult
from pagedkv.sim.metrics import RunResult, TimeSeries
from pagedkv.sim.summary import ideal_hits, summarize
from pagedkv.traces import TraceRequest

_SHARES = ("kv_utilization_mean", "fragmentation_mean", "reserved_unused_mean", "cached_mean")
_PER_REPLICA = (
    "num_finished",
    "prefix_hit_tokens",
    "ttft_p50_s",
    "ttft_p99_s",
    "throughput_tokens_per_s",
    "mean_running",
    "peak_running",
    "preemptions",
    "evictions",
)
_SUMS = (
    "num_steps",
    "preemptions",
    "recomputed_tokens",
    "evictions",
    "swap_outs",
    "swap_ins",
    "swapped_blocks_out",
    "swapped_blocks_in",
    "swap_fallbacks",
    "partial_hits",
    "partial_hit_tokens",
    "partial_claims",
    "prefix_copy_bytes",
    "prefix_copy_time_s",
)


def cluster_ideal_hits(requests: Sequence[TraceRequest], result: ClusterResult) -> int | None:
    """The hit ceiling of one never-evicting engine over the requests that were not refused
    (None without a prefix cache): the same rule as ``Comparison``'s."""
    if not result.policy.prefix_caching:
        return None
    first = result.replicas[0]
    return ideal_hits(requests, result.records, first.policy.prefix_match_unit or first.block_size)


def summarize_cluster(
    result: ClusterResult,
    ideal_prefix_hit_tokens: int | None = None,
    *,
    balance: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """The flat summary of ``result`` (see the module docstring); ``balance``: the
    prefix-aware band (abs, rel) to record."""
    reps = result.replicas
    per = [summarize(r) for r in reps]
    total = RunResult(
        policy=result.policy,
        block_size=reps[0].block_size,
        num_kv_slots=reps[0].num_kv_slots,
        records=result.records,
        series=TimeSeries(),
        duration_s=result.duration_s,
        num_steps=0,
        peak_running=max(r.peak_running for r in reps),
        mean_running=sum(r.mean_running for r in reps),
        preemptions=0,
        recomputed_tokens=0,
        evictions=0,
        wall_time_s=result.wall_time_s,
        swap_time_s=sum(r.swap_time_s for r in reps),
    )
    for name in _SUMS:
        setattr(total, name, sum(getattr(r, name) for r in reps))
    out = summarize(total, ideal_prefix_hit_tokens)
    for name in _SHARES:
        out[name] = round(sum(s[name] for s in per) / len(per), 6)
    out["kv_utilization_peak"] = max(s["kv_utilization_peak"] for s in per)
    ideal = ideal_prefix_hit_tokens
    imbalance = result.load_imbalance
    out.update(
        router=result.router,
        num_replicas=len(reps),
        balance_abs=balance[0] if balance else None,
        balance_rel=balance[1] if balance else None,
        prefix_hit_of_ideal=round(out["prefix_hit_tokens"] / ideal, 6) if ideal else None,
        load_imbalance=round(imbalance, 6) if imbalance is not None else None,
        routing_decisions=dict(sorted(result.decisions.items())),
        index_events=result.num_index_events,
        replicas=[
            {
                "replica": f"r{i}",
                "num_requests": len(r.records),
                **{name: s[name] for name in _PER_REPLICA},
            }
            for i, (r, s) in enumerate(zip(reps, per, strict=True))
        ],
    )
    return out
