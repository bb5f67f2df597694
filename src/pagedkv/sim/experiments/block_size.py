"""The PagedAttention paper's block-size ablation (vLLM, SOSP 2023, §7.2, Fig. 18b).

OPT-13B on one A100-40GB with the paper's 12 GiB KV cache (its Table 1: 15.7K token slots),
the fitted GPU clock with the paper's paged kernel (``FittedCostModel(backend="vllm")``: every
op priced from measured A100 kernel times, the block walk's dependence on B from the paper's
Fig. 18a; ``sim/vllm_class/cost.py``), paged allocation without a prefix
cache (the paper's "basic sampling" shares nothing), block sizes 1..256, the ShareGPT-like and
Alpaca-like workloads at a few Poisson request rates each. The metric is the paper's
normalized latency: the mean over requests of end-to-end latency / output tokens (s/token).

The scheduler is shaped like the paper's vLLM v0: no chunked prefill (a prompt step holds whole
prompts), at most 256 running sequences and 2,560 batched tokens, a 2,048-token context.
The rates are **chosen here** (the paper does not state its ablation's rates): light, medium
and heavy load for this model's capacity on the fitted clock. ``run`` spreads the points over the cores (``runner.run_points``).

**Partial-block reuse beside it.** The paper's workloads share nothing, so its curve cannot show
the third ledger. A second sweep (``partial_reuse`` in the result) gives every ShareGPT-like
request one of ``NUM_SYSTEM_PROMPTS`` shared system prompts (``SYSTEM_TOKENS`` long, drawn once
per seed; **chosen here**), runs paged allocation *with* a prefix cache at every block size,
whole blocks (U = B) beside a prefix-match unit of one token (U = 1, ``kvcache/partial.py``, its
copies priced on the GPU's memory), and reports normalized latency and prefix-hit tokens.

``clock="pagedkv-triton"`` runs the same sweep on pagedkv's own engine instead: Llama-3-8B on
the H200 its clock was measured on (``sim/pagedkv_triton/cost.py``, CUDA graphs), the engine's
scheduler (chunked prefill, 8,192 tokens a step), the 40 GiB KV pool of the device check's
engine section, the block sizes its Triton kernels accept (16-256), and rates chosen the same
way for that engine's capacity. The vLLM-class clock (the default) is the paper's setup.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import CostModel, ModelCost
from pagedkv.sim.experiments.runner import run_points
from pagedkv.sim.gpus import get_gpu
from pagedkv.sim.links import device_copy
from pagedkv.sim.simulator import Simulation
from pagedkv.sim.vllm_class.cost import block_walk_factor, fitted_cost_model
from pagedkv.traces import TraceRequest
from pagedkv.traces.paper_workloads import WORKLOADS, paper_workload

DESCRIPTION = (
    "PagedAttention §7.2 block-size ablation: normalized latency vs request rate for block "
    "sizes 1..256, OPT-13B on A100-40GB, ShareGPT-like and Alpaca-like workloads"
)
DESCRIPTION_PAGEDKV = (
    "the block-size sweep on pagedkv's own engine: normalized latency vs request rate for block "
    "sizes 16..256, Llama-3-8B on H200-141GB (pagedkv-triton clock), ShareGPT-like and Alpaca-like"
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
CLOCKS = ("vllm-class", "pagedkv-triton")
# The partial-reuse sweep (module docstring): its workload, rates and system prompts.
PREFIX_WORKLOAD = "sharegpt"
PREFIX_RATES_PER_S: dict[str, tuple[float, ...]] = {
    "vllm-class": (1.0, 1.75),
    "pagedkv-triton": (10.0, 30.0),
}
NUM_SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = (32, 480)  # uniform, both ends
SYSTEM_SEGMENT_BASE = 3_000_000  # segment ids of the system prompts (below the fresh ones)
PREFIX_NUM_REQUESTS, QUICK_PREFIX_NUM_REQUESTS = 1000, 150


@dataclass(frozen=True)
class Setup:
    """What one clock's sweep runs: model, GPU, pool, block sizes, rates, scheduler."""

    model: str
    gpu: str
    kv_pool_bytes: int
    block_sizes: tuple[int, ...]
    rates_per_s: Mapping[str, tuple[float, ...]]
    scheduler: SchedulerConfig


PAGEDKV_SETUP = Setup(
    "llama-3-8b",
    "H200-141GB",
    40 * 2**30,
    (16, 32, 64, 128, 256),
    {"sharegpt": (10.0, 20.0, 30.0, 40.0), "alpaca": (50.0, 100.0, 200.0, 300.0)},
    SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048),
)


def setup_of(clock: str) -> Setup:
    """The sweep of ``clock`` (``CLOCKS``); ValueError for another name."""
    if clock == "vllm-class":
        return Setup(MODEL, GPU, KV_POOL_BYTES, BLOCK_SIZES, RATES_PER_S, SCHEDULER)
    if clock == "pagedkv-triton":
        return PAGEDKV_SETUP
    raise ValueError(f"unknown clock {clock!r} (known: {', '.join(CLOCKS)})")


@dataclass(frozen=True)
class Point:
    workload: str
    rate_per_s: float
    block_size: int
    num_requests: int
    seed: int = 0
    clock: str = "vllm-class"
    # The partial-reuse sweep: a prefix cache matching in units of U (None: whole blocks);
    # None with ``shared_prefixes`` False is the paper's point (no prefix cache).
    prefix_match_unit: int | None = None
    shared_prefixes: bool = False


def _cost(clock: str = "vllm-class") -> CostModel:
    """The sweep's step clock: the paper's kernel on the vLLM-class clock, or pagedkv's."""
    if clock == "vllm-class":
        return fitted_cost_model(MODEL, GPU, BACKEND)
    from pagedkv.pages.sources import load_shape
    from pagedkv.sim.clock_presets import engine_clock_for
    from pagedkv.sim.gpus import get_gpu
    from pagedkv.sim.pagedkv_triton.cost import EngineCostModel

    setup = setup_of(clock)
    gpu = get_gpu(setup.gpu)
    engine, source = engine_clock_for(gpu)
    model = ModelCost.from_shape(load_shape(setup.model))
    return EngineCostModel(model, gpu, engine, cuda_graphs=True, source=source)


def _record_bytes(cost: CostModel) -> int:
    return cost.model.kv_record_bytes  # type: ignore[attr-defined]


def with_system_prompts(requests: list[TraceRequest], seed: int) -> list[TraceRequest]:
    """``requests`` each prefixed with one of ``NUM_SYSTEM_PROMPTS`` shared system prompts
    (lengths uniform over ``SYSTEM_TOKENS``, the prompt of each request drawn at random)."""
    rng = random.Random(seed)
    systems = [
        ((SYSTEM_SEGMENT_BASE + i, rng.randint(*SYSTEM_TOKENS)),) for i in range(NUM_SYSTEM_PROMPTS)
    ]
    return [replace(r, prompt=rng.choice(systems) + r.prompt) for r in requests]


def run_point(point: Point) -> dict[str, Any]:
    """One replay: the point's fields plus its normalized latency and load figures."""
    cost, setup = _cost(point.clock), setup_of(point.clock)
    requests = paper_workload(point.workload, point.num_requests, point.rate_per_s, point.seed)
    policy = get_policy(f"paged-nocache:{point.block_size}")
    copier = None
    if point.shared_prefixes:
        requests = with_system_prompts(requests, point.seed)
        policy = get_policy(f"paged:{point.block_size}")
        policy = policy.with_prefix_match_unit(point.prefix_match_unit)
        gpu = get_gpu(setup.gpu)
        layers = cost.model.num_layers  # type: ignore[attr-defined]
        copier = device_copy(gpu.name, gpu.mem_bandwidth_bytes_per_s, layers)
    record_bytes = _record_bytes(cost)
    slots = setup.kv_pool_bytes // record_bytes
    sim = Simulation(
        requests,
        policy,
        slots,
        setup.scheduler,
        cost,
        device_copy=copier,
        kv_record_bytes=record_bytes,
    )
    result = sim.run()
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
        "prefix_hit_tokens": sum(r.prefix_hit_tokens for r in done),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "prefix_copy_time_s": result.prefix_copy_time_s,
    }


def points(quick: bool, clock: str = "vllm-class") -> list[Point]:
    counts = QUICK_NUM_REQUESTS if quick else NUM_REQUESTS
    setup = setup_of(clock)
    return [
        Point(w, rate, b, counts[w], clock=clock)
        for w, rates in setup.rates_per_s.items()
        for rate in rates
        for b in setup.block_sizes
    ]


def prefix_points(quick: bool, clock: str = "vllm-class") -> list[Point]:
    """The partial-reuse sweep: every block size, whole blocks and U = 1, at each rate."""
    n = QUICK_PREFIX_NUM_REQUESTS if quick else PREFIX_NUM_REQUESTS
    grid = [
        (rate, b, unit)
        for rate in PREFIX_RATES_PER_S[clock]
        for b in setup_of(clock).block_sizes
        for unit in (None, 1)
    ]
    return [
        Point(PREFIX_WORKLOAD, rate, b, n, clock=clock, prefix_match_unit=u, shared_prefixes=True)
        for rate, b, u in grid
    ]


def best_block_sizes(
    rows: list[dict[str, Any]], tolerance: float = 0.05, clock: str = "vllm-class"
) -> dict[str, Any]:
    """Per workload and rate: the block size of least normalized latency, and every block
    size within ``tolerance`` (relative) of it."""
    out: dict[str, dict[str, Any]] = {}
    rates_per_s = setup_of(clock).rates_per_s
    for w in rates_per_s:
        for rate in rates_per_s[w]:
            at = [r for r in rows if r["workload"] == w and r["rate_per_s"] == rate]
            if not at:
                continue
            best = min(at, key=lambda r: r["normalized_latency_s_per_token"])
            limit = best["normalized_latency_s_per_token"] * (1 + tolerance)
            near = [r["block_size"] for r in at if r["normalized_latency_s_per_token"] <= limit]
            out.setdefault(w, {})[f"{rate:g}"] = {"best": best["block_size"], "within_5%": near}
    return out


def run(
    *, quick: bool, workers: int | None, progress=None, clock: str = "vllm-class"
) -> dict[str, Any]:
    """Every point of the sweep (JSON-ready), the setup and the best block sizes, on
    ``clock`` (``CLOCKS``)."""
    paper, shared = points(quick, clock), prefix_points(quick, clock)
    all_rows = run_points(run_point, paper + shared, workers, progress)
    rows, shared_rows = all_rows[: len(paper)], all_rows[len(paper) :]
    cost, setup = _cost(clock), setup_of(clock)
    law = (
        {
            "decode_attention_vs_measured_b16": {
                b: block_walk_factor(b, BACKEND) for b in BLOCK_SIZES
            },
            "kernel": BACKEND,
        }
        if clock == "vllm-class"
        else {"kernel": "pagedkv triton (paged decode law fitted to the ledger)"}
    )
    return {
        "experiment": "block-size",
        "description": DESCRIPTION if clock == "vllm-class" else DESCRIPTION_PAGEDKV,
        "quick": quick,
        "setup": {
            "clock_kind": clock,
            "model": setup.model,
            "gpu": setup.gpu,
            "kv_pool_bytes": setup.kv_pool_bytes,
            "kv_pool_slots": setup.kv_pool_bytes // _record_bytes(cost),
            "clock": cost.source,  # type: ignore[attr-defined]
            **law,
            "scheduler": asdict(setup.scheduler),
            "policy": "paged-nocache:B",
            "workloads": {w: WORKLOADS[w].source for w in RATES_PER_S},
            "metric": "mean over requests of end-to-end latency / output tokens (s/token)",
        },
        "best": best_block_sizes(rows, clock=clock),
        "points": rows,
        "partial_reuse": {
            "workload": f"{PREFIX_WORKLOAD}-like, each request after one of "
            f"{NUM_SYSTEM_PROMPTS} shared system prompts of {SYSTEM_TOKENS[0]}-"
            f"{SYSTEM_TOKENS[1]} tokens (chosen here)",
            "policy": "paged:B with a prefix cache; prefix_match_unit None (whole blocks) or 1",
            "copy_price": "sim/links.py device_copy on the GPU's memory",
            "points": shared_rows,
        },
    }


def plot(result: dict[str, Any], png_path: Path) -> None:
    """One panel per workload: normalized latency vs request rate, one line per block size."""
    from pagedkv.sim.experiments.block_size_plot import plot_block_size

    plot_block_size(result, png_path)
