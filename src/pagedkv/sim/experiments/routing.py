"""Routing at scale: the Mooncake conversation trace over 2..64 replicas, three routers.

Each point is one ``pagedkv simulate`` run (the same library call: ``load_scenario`` +
``Scenario.run_cluster``) of the whole trace on N replicas of Llama-3-8B on an H100-80GB
(vLLM policy: paged blocks of 16 with the hash-chain prefix cache; the KV pool derived from the
GPU: 80 GB x 0.9 - 16.1 GB of weights - 4 GiB of activations = 394,016 tokens; the kernel
cost model of vLLM's flash-attn backend), behind round-robin, least-loaded and prefix-aware
routing (prefix-aware's default band: 4 requests or 25 %).

The arrival rate scales with N: ``rate_scale = N / REFERENCE_REPLICAS``, so every replica
sees the same share of the trace's own rate at every N (half of it with the reference of 2).
Why half: one such engine at the trace's own rate is overloaded (measured: TTFT p50 27 s,
p99 99 s, 3,605 preemptions over the hour, hits 6.0M of the 37.0M ceiling), while at half the
rate the replicas run a few dozen sequences with a full KV pool and TTFTs well under a second:
loaded, not drowning, so that routing, not queueing, decides the outcome.

The hit ceiling (``ideal_prefix_hit_tokens``) is what one engine with an infinite cache would
reuse over the trace: every point reports its share of it.

Every point in one JSON (``run``), one figure (``plot``); ``--quick`` replays the first
``QUICK_NUM_REQUESTS`` requests at 2, 4 and 8 replicas (a smoke run, not the figure).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.sim.experiments.runner import run_points
from pagedkv.sim.simulate_config import SimulateConfig
from pagedkv.traces import require_shared_trace

DESCRIPTION = (
    "routing at scale: the Mooncake conversation trace on 2..64 replicas (Llama-3-8B, "
    "H100-80GB, vllm policy, rate x N/2), round-robin vs least-loaded vs prefix-aware"
)
TRACE_NAME = "mooncake_conversation.jsonl"
MODEL, GPU, POLICY = "llama-3-8b", "H100-80GB", "vllm"
REFERENCE_REPLICAS = 2  # rate_scale = N / 2: each replica sees half the trace's own rate
REPLICAS = (2, 4, 8, 16, 32, 64)
QUICK_REPLICAS = (2, 4, 8)
ROUTERS = ("round-robin", "least-loaded", "prefix-aware")
QUICK_NUM_REQUESTS = 1500
# Kept in the JSON per point (the per-replica lists are kept whole).
_FIELDS = (
    "num_requests",
    "num_finished",
    "refused",
    "prompt_tokens",
    "output_tokens",
    "prefix_hit_tokens",
    "ideal_prefix_hit_tokens",
    "prefix_hit_of_ideal",
    "prefix_hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "throughput_tokens_per_s",
    "duration_s",
    "mean_running",
    "peak_running",
    "load_imbalance",
    "kv_utilization_mean",
    "cached_mean",
    "preemptions",
    "evictions",
    "num_steps",
    "routing_decisions",
    "index_events",
    "num_kv_slots",
    "replicas",
)


def find_trace() -> Path:
    """The shared Mooncake conversation trace (``pagedkv.traces.require_shared_trace``);
    UsageError naming every place looked in otherwise."""
    try:
        return require_shared_trace(TRACE_NAME)
    except UsageError as exc:
        raise UsageError(f"the routing experiment replays {exc}") from None


@dataclass(frozen=True)
class Point:
    num_replicas: int
    router: str
    rate_scale: float
    max_requests: int | None
    trace: str


def config_for(point: Point) -> SimulateConfig:
    """The point as a ``pagedkv simulate`` configuration (the docs print it as a command)."""
    return SimulateConfig(
        trace=point.trace,
        model=MODEL,
        gpu=GPU,
        policies=(POLICY,),
        rate_scale=point.rate_scale,
        max_requests=point.max_requests,
        num_replicas=point.num_replicas,
        routers=(point.router,),
        # the clock docs/experiments.md's routing figures were made with (the roofline plus
        # flash-attn's assumed block walk); the fitted clock is slower per step, which moves
        # the rate at which one replica saturates: rerun with it before comparing
        cost="kernel",
    )


def run_point(point: Point) -> dict[str, Any]:
    """One cluster run: the point's fields, the summary's ``_FIELDS`` and the wall time."""
    from pagedkv.sim.scenario_load import load_scenario

    start = time.perf_counter()
    ((_, summary),) = load_scenario(config_for(point)).run_cluster()
    out = {k: v for k, v in asdict(point).items() if k != "trace"}
    out.update({k: summary[k] for k in _FIELDS})
    out["wall_time_s"] = round(time.perf_counter() - start, 2)
    return out


def points(quick: bool, trace: str, replicas: Sequence[int] | None = None) -> list[Point]:
    """The sweep, biggest N first (the slowest points start first on a pool of workers)."""
    counts = replicas or (QUICK_REPLICAS if quick else REPLICAS)
    max_requests = QUICK_NUM_REQUESTS if quick else None
    return [
        Point(n, router, n / REFERENCE_REPLICAS, max_requests, trace)
        for n in sorted(counts, reverse=True)
        for router in ROUTERS
    ]


def run(
    *, quick: bool, workers: int | None, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Every point, JSON-ready, sorted by N then router."""
    trace = str(find_trace())
    rows = run_points(run_point, points(quick, trace), workers, progress)
    rows.sort(key=lambda r: (r["num_replicas"], ROUTERS.index(r["router"])))
    return {
        "experiment": "routing",
        "description": DESCRIPTION,
        "setup": {
            "trace": TRACE_NAME,
            "model": MODEL,
            "gpu": GPU,
            "policy": POLICY,
            "reference_replicas": REFERENCE_REPLICAS,
            "rate_scale": "num_replicas / reference_replicas",
            "routers": list(ROUTERS),
            "balance_abs": SimulateConfig.balance_abs,
            "balance_rel": SimulateConfig.balance_rel,
            "max_requests": QUICK_NUM_REQUESTS if quick else None,
            "command": "pagedkv simulate --trace ../shared/traces/mooncake_conversation.jsonl "
            "--model llama-3-8b --gpu H100-80GB --policy vllm --cost kernel --replicas N --rate-scale N/2 "
            "--router round-robin,least-loaded,prefix-aware --json",
        },
        "quick": quick,
        "points": rows,
    }


def plot(result: dict[str, Any], png_path: Path) -> None:
    """Prefix hits (share of the ceiling), TTFT p50 and p99, load imbalance vs N per router."""
    from pagedkv.sim.experiments.routing_plot import plot_routing

    plot_routing(result, Path(png_path))
