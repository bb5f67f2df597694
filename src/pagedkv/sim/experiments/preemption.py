"""Swap vs recompute per block size: the vLLM paper's §7 comparison, on the simulator.

Three parts, all in one JSON (``run``) and one figure (``plot``):

(a) the first article's worked example, pure arithmetic: evicting 1 GiB of KV at 4 KiB per
    token takes ``262,144 / B`` block transfers (2,048 at B=128, 16,384 at 16, 32,768 at 8),
    and its swap latency on the A100's host link (``sim/links.py``);
(b) the paper's micro-benchmark for OPT-13B on A100-40GB: moving 1 GiB of its KV (1,310
    tokens) one way, per B, at one transfer per block (the article's count) and at
    ``2 * num_layers`` per block (one K and one V tensor per layer, as vLLM v0 copies), vs
    recomputing the same tokens (one prefill step of the cost model: flat in B);
(c) end to end: the paper's normalized latency (mean over requests of end-to-end latency /
    output tokens) per block size on a ShareGPT-like workload at a rate that preempts, with
    recompute and with swap (both transfer counts), through the real scheduler.

Assumptions (stated in docs/swap.md as well): the KV pool is the paper's ~30 % of the A100's
40 GB (12 GB, Figure 1); the swap space is vLLM's default 4 GiB; vLLM v0's scheduler limits
(2,048 batched tokens, no chunked prefill, no prefix cache); the clock is the fitted GPU clock with the
paper's paged kernel (``FittedCostModel(backend="vllm")``, ``sim/vllm_class/cost.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sched.step_shape import StepShape
from pagedkv.sim.cost_model import CostModel, ModelCost
from pagedkv.sim.experiments.runner import run_points
from pagedkv.sim.links import host_link_for_gpu
from pagedkv.sim.simulator import Simulation
from pagedkv.sim.vllm_class.cost import FittedCostModel, fitted_cost_model

DESCRIPTION = (
    "swap vs recompute preemption per block size (vLLM paper §7): transfers for 1 GiB, "
    "swap/recompute latency, end-to-end normalized latency (OPT-13B, A100-40GB, ShareGPT-like)"
)

GPU = "A100-40GB"
GIB = 2**30
ARTICLE_RECORD_BYTES = 4096  # the article's example: 4 KiB of KV per token
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_BLOCK_SIZES = (1, 4, 16, 64, 256)
KV_POOL_BYTES = 12 * 10**9  # ~30 % of 40 GB once OPT-13B's 26 GB are loaded (paper, Fig. 1)
SWAP_SPACE_BYTES = 4 * GIB  # vLLM's default --swap-space
MAX_MODEL_LEN = 2048  # OPT's context
MAX_BATCHED_TOKENS = 2048  # vLLM v0: max(max_model_len, 2048), no chunked prefill
MAX_NUM_SEQS = 256  # vLLM's default, which the paper's runs kept
RATE_PER_S = 3.0  # ShareGPT-like requests per second: the pool fills and preempts
NUM_REQUESTS, QUICK_NUM_REQUESTS = 400, 120
SEED = 0


def _cost() -> FittedCostModel:
    """The fitted clock of OPT-13B (the planner's ``opt-13b`` preset) on the paper's GPU."""
    return fitted_cost_model("opt-13b", GPU, backend="vllm")


class Point(NamedTuple):
    block_size: int
    mode: str  # "recompute" or "swap"
    transfers_per_block: int
    num_requests: int


def _e2e_point(point: Point) -> dict[str, Any]:
    """One end-to-end run (module level: ``run_points`` pickles it)."""
    from pagedkv.traces.paper_workloads import paper_workload

    cost = _cost()
    model = cost.model
    swap = point.mode == "swap"
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        chunked_prefill=False,
        preemption_mode=point.mode,
        swap_space_slots=SWAP_SPACE_BYTES // model.kv_record_bytes if swap else 0,
    )
    result = Simulation(
        paper_workload("sharegpt", point.num_requests, RATE_PER_S, SEED),
        get_policy(f"paged-nocache:{point.block_size}"),
        KV_POOL_BYTES // model.kv_record_bytes,
        config,
        cost,
        link=host_link_for_gpu(GPU),
        kv_record_bytes=model.kv_record_bytes,
        transfers_per_block=point.transfers_per_block,
    ).run()
    norm = [  # seconds per output token of each finished request
        (r.finish_s - r.arrival_s) / max(1, r.num_output_tokens)
        for r in result.records
        if not r.refused and r.finish_s is not None
    ]
    return {
        **point._asdict(),
        "normalized_latency_s_per_token": sum(norm) / len(norm) if norm else None,
        "num_finished": len(norm),
        "num_refused": sum(r.refused for r in result.records),
        "preemptions": result.preemptions,
        "recomputed_tokens": result.recomputed_tokens,
        "swap_outs": result.swap_outs,
        "swap_ins": result.swap_ins,
        "swapped_blocks_out": result.swapped_blocks_out,
        "swapped_blocks_in": result.swapped_blocks_in,
        "swap_fallbacks": result.swap_fallbacks,
        "swap_time_s": result.swap_time_s,
        "duration_s": result.duration_s,
    }


def _micro(
    block_sizes: tuple[int, ...], model: ModelCost, num_layers: int, cost: CostModel
) -> dict[str, Any]:
    """Parts (a) and (b): transfer counts and one-way latencies for 1 GiB of KV."""
    link = host_link_for_gpu(GPU)
    article_tokens = GIB // ARTICLE_RECORD_BYTES
    opt_tokens = GIB // model.kv_record_bytes
    layers_x2 = 2 * num_layers
    article, opt = [], []
    for b in block_sizes:
        n = math.ceil(article_tokens / b)
        article.append(
            {
                "block_size": b,
                "transfers": n,
                "swap_s": link.transfer_time_s(n, b * ARTICLE_RECORD_BYTES),
            }
        )
        blocks = math.ceil(opt_tokens / b)
        block_bytes = b * model.kv_record_bytes
        shape = StepShape(
            opt_tokens,
            opt_tokens,
            opt_tokens * (opt_tokens + 1) // 2,
            num_seqs=1,
            kv_blocks_read=blocks,
            block_size=b,
        )
        opt.append(
            {
                "block_size": b,
                "blocks": blocks,
                "swap_s_one_transfer_per_block": link.transfer_time_s(blocks, block_bytes),
                "swap_s_per_layer_transfers": link.transfer_time_s(blocks, block_bytes, layers_x2),
                "recompute_s": cost.step_time_s(shape),
            }
        )
    return {
        "article_example": {
            "kv_bytes": GIB,
            "record_bytes": ARTICLE_RECORD_BYTES,
            "tokens": article_tokens,
            "points": article,
        },
        "opt13b": {
            "kv_bytes": GIB,
            "record_bytes": model.kv_record_bytes,
            "tokens": opt_tokens,
            "transfers_per_block_per_layer": layers_x2,
            "points": opt,
        },
    }


def run(
    *, quick: bool, workers: int | None, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Every point of parts (a), (b) and (c), JSON-ready. ``quick``: fewer block sizes and
    requests (a smoke test, not the figure)."""
    cost = _cost()
    model = cost.model
    num_layers = model.num_layers
    link = host_link_for_gpu(GPU)
    block_sizes = QUICK_BLOCK_SIZES if quick else BLOCK_SIZES
    num_requests = QUICK_NUM_REQUESTS if quick else NUM_REQUESTS
    layers_x2 = 2 * num_layers
    points = [
        Point(b, mode, tpb, num_requests)
        for b in block_sizes
        for mode, tpb in (("recompute", 1), ("swap", 1), ("swap", layers_x2))
    ]
    e2e = run_points(_e2e_point, points, workers, progress)
    return {
        "experiment": "preemption",
        "description": DESCRIPTION,
        "model": model.name,
        "gpu": GPU,
        "cost_model": "fitted GPU clock, vllm kernel",
        "clock": cost.source,
        "link": {
            "name": link.name,
            "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
            "per_transfer_s": link.per_transfer_s,
            "source": link.source,
        },
        "workload": {"name": "sharegpt", "requests": num_requests, "rate_per_s": RATE_PER_S},
        "kv_pool_bytes": KV_POOL_BYTES,
        "swap_space_bytes": SWAP_SPACE_BYTES,
        "scheduler": {
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "chunked_prefill": False,
            "max_model_len": MAX_MODEL_LEN,
            "policy": "paged-nocache:B",
        },
        "quick": quick,
        **_micro(BLOCK_SIZES, model, num_layers, cost),  # arithmetic: always every B
        "end_to_end": e2e,
    }


def plot(result: dict[str, Any], png_path: Path) -> None:
    """Three panels: (a) transfers and swap latency of the article's 1 GiB example, (b) OPT-13B
    swap vs recompute latency for 1 GiB, (c) end-to-end normalized latency per block size."""
    from pagedkv.sim.experiments.preemption_plot import save_preemption_plot

    save_preemption_plot(result, Path(png_path))
