"""The PagedAttention paper's block-size ablation (vLLM, SOSP 2023, §7.2, Fig. 18b).

OPT-13B on one A100-40GB with the paper's 12 GiB KV cache (its Table 1: 15.7K token slots),
the fitted GPU clock with the paper's paged kernel (``FittedCostModel(backend="vllm")``: every
op priced from measured A100 kernel times, the block walk's dependence on B from the paper's
Fig. 18a; ``sim/fitted_cost.py``), paged allocation without a prefix
cache (the paper's "basic sampling" shares nothing), block sizes 1..256, the ShareGPT-like and
Alpaca-like workloads at a few Poisson request rates each. The metric is the paper's
normalized latency: the mean over requests of end-to-end latency / output tokens (s/token).

The scheduler is shaped like the paper's vLLM v0: no chunked prefill (a prompt step holds whole
prompts), at most 256 running sequences and 2,560 batched tokens, a 2,048-token context.
The rates are **chosen here** (the paper does not state its ablation's rates): light, medium
and heavy load for this model's capacity on the fitted clock. ``run`` spreads the points over the cores (``runner.run_points``).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.experiments.runner import run_points
from pagedkv.sim.fitted_cost import FittedCostModel, block_walk_factor, fitted_cost_model
from pagedkv.sim.simulator import Simulation
from pagedkv.traces.paper_workloads import WORKLOADS, paper_workload

DESCRIPTION = (
    "PagedAttention §7.2 block-size ablation: normalized latency vs request rate for block "
    "sizes 1..256, OPT-13B on A100-40GB, ShareGPT-like and Alpaca-like workloads"
)
MODEL, GPU, BACKEND = "opt-13b", "A100-40GB", "vllm"
KV_POOL_BYTES = 12 * 2**30  # the paper's Table 1: 12 GB of KV for OPT-13B (15.7K slots)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATES_PER_S = {"sharegpt": (1.0, 1.5, 1.75, 2.0), "alpaca": (20.0, 30.0, 40.0, 45.0)}
# Requests per point: enough for a steady state at the highest rate (> 5x the running
# sequences), few enough that the 72 points take < 2 min on 2 cores (measured: docs).
NUM_REQUESTS = {"sharegpt": 1000, "alpaca": 1500}
QUICK_NUM_REQUESTS = {"sharegpt": 150, "alpaca": 250}
SCHEDULER = SchedulerConfig(
    max_num_seqs=256, max_num_batched_tokens=2560, max_model_len=2048, chunked_prefill=False
)


@dataclass(frozen=True)
class Point:
    workload: str
    rate_per_s: float
    block_size: int
    num_requests: int
    seed: int = 0


def _cost() -> FittedCostModel:
    return fitted_cost_model(MODEL, GPU, BACKEND)


def run_point(point: Point) -> dict[str, Any]:
    """One replay: the point's fields plus its normalized latency and load figures."""
    cost = _cost()
    requests = paper_workload(point.workload, point.num_requests, point.rate_per_s, point.seed)
    policy = get_policy(f"paged-nocache:{point.block_size}")
    slots = KV_POOL_BYTES // cost.model.kv_record_bytes
    result = Simulation(requests, policy, slots, SCHEDULER, cost).run()
    done = [r for r in result.records if not r.refused and r.e2e_s is not None]
    normalized = [r.e2e_s / max(1, r.num_output_tokens) for r in done]  # type: ignore[operator]
    return {
        **asdict(point),
        "normalized_latency_s_per_token": statistics.fmean(normalized),
        "mean_e2e_latency_s": statistics.fmean(r.e2e_s for r in done),  # type: ignore[misc]
        "num_refused": len(result.records) - len(done),
        "mean_running": result.mean_running,
        "peak_running": result.peak_running,
        "preemptions": result.preemptions,
        "duration_s": result.duration_s,
        "num_steps": result.num_steps,
    }


def points(quick: bool) -> list[Point]:
    counts = QUICK_NUM_REQUESTS if quick else NUM_REQUESTS
    return [
        Point(w, rate, b, counts[w])
        for w, rates in RATES_PER_S.items()
        for rate in rates
        for b in BLOCK_SIZES
    ]


def best_block_sizes(rows: list[dict[str, Any]], tolerance: float = 0.05) -> dict[str, Any]:
    """Per workload and rate: the block size of least normalized latency, and every block
    size within ``tolerance`` (relative) of it."""
    out: dict[str, dict[str, Any]] = {}
    for w in RATES_PER_S:
        for rate in RATES_PER_S[w]:
            at = [r for r in rows if r["workload"] == w and r["rate_per_s"] == rate]
            if not at:
                continue
            best = min(at, key=lambda r: r["normalized_latency_s_per_token"])
            limit = best["normalized_latency_s_per_token"] * (1 + tolerance)
            near = [r["block_size"] for r in at if r["normalized_latency_s_per_token"] <= limit]
            out.setdefault(w, {})[f"{rate:g}"] = {"best": best["block_size"], "within_5%": near}
    return out


def run(*, quick: bool, workers: int | None, progress=None) -> dict[str, Any]:
    """Every point of the sweep (JSON-ready), the setup and the best block sizes."""
    rows = run_points(run_point, points(quick), workers, progress)
    cost = _cost()
    return {
        "experiment": "block-size",
        "description": DESCRIPTION,
        "quick": quick,
        "setup": {
            "model": MODEL,
            "gpu": GPU,
            "kv_pool_bytes": KV_POOL_BYTES,
            "kv_pool_slots": KV_POOL_BYTES // cost.model.kv_record_bytes,
            "kernel": BACKEND,
            "clock": cost.source,
            "decode_attention_vs_measured_b16": {
                b: block_walk_factor(b, BACKEND) for b in BLOCK_SIZES
            },
            "scheduler": asdict(SCHEDULER),
            "policy": "paged-nocache:B",
            "workloads": {w: WORKLOADS[w].source for w in RATES_PER_S},
            "metric": "mean over requests of end-to-end latency / output tokens (s/token)",
        },
        "best": best_block_sizes(rows),
        "points": rows,
    }


def plot(result: dict[str, Any], png_path: Path) -> None:
    """One panel per workload: normalized latency vs request rate, one line per block size."""
    from pagedkv.sim.experiments.block_size_plot import plot_block_size

    plot_block_size(result, png_path)
