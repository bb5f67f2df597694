"""Fitting an ``EngineClock``'s step parameters to timed engine steps (``pagedkv calibrate
--from-gpu-check``), with the decode law (fitted to the ledger) and the GEMM law held fixed.

The host first, when the check timed host-only steps (the engine's steps with the model's
forward removed, ``fit_host``): per step, per sequence, per block-table entry and per new
token, a non-negative least squares of the relative error; those four are then held fixed.
Without them the host's base and per-sequence cost are fitted with the rest, and the table
and token terms stay 0: eager steps cannot tell a per-step host cost from the launches the
GPU hides (both are constant a step), nor a per-sequence host cost from decode attention
the launches hide.

What the steps fit (``STEP_PARAMS``): the host's base and per-sequence cost, the eager
launches per layer and how far the GPU hides them (``overlap_p``), every non-GEMM kernel per
token, the prefill kernel's launch, its cost per decode-row KV token and per chunk query-key
pair, and, when CUDA-graph steps were timed, what a graph replay costs. One robust least
squares of the relative error over the logarithms of those parameters (all stay > 0; the
overlap exponent as ``p - 1``), from a few spread starts. Without graph steps,
``graph_replay_s`` keeps the base clock's value and the clock's ``sources`` says so: a graph
replay then removes exactly the launches the eager steps were fitted to carry, an assumption
the host/launch split (identified only through the eager overlap) rests on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pagedkv.sched.step_shape import StepShape, TimedStep
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.pagedkv_triton.clock import EngineClock
from pagedkv.sim.pagedkv_triton.cost import EngineCostModel
from pagedkv.sim.pagedkv_triton.step_context import longest_context_tokens

STEP_PARAMS = (
    "host_base_s",
    "host_per_seq_s",
    "launch_per_layer_s",
    "overlap_p",
    "gpu_per_token_s",
    "prefill_launch_s",
    "prefill_decode_token_s",
    "prefill_pair_s",
)
GRAPH_PARAMS = ("graph_replay_s",)
HOST_PARAMS = ("host_base_s", "host_per_seq_s", "host_per_table_entry_s", "host_per_token_s")
STARTS = {
    "host_base_s": 1e-3,
    "host_per_seq_s": 2e-5,
    "launch_per_layer_s": 3e-4,
    "overlap_p": 2.0,
    "gpu_per_token_s": 1e-7,
    "prefill_launch_s": 2e-5,
    "prefill_decode_token_s": 2e-8,
    "prefill_pair_s": 2e-8,
    "graph_replay_s": 1e-4,
}


def _to_x(name: str, value: float) -> float:
    return math.log(max(value - 1.0, 1e-6) if name == "overlap_p" else max(value, 1e-12))


def _from_x(name: str, x: float) -> float:
    return 1.0 + math.exp(x) if name == "overlap_p" else math.exp(x)


def step_errors(
    clock: EngineClock, model: ModelCost, gpu: GPUSpec, steps: Sequence[TimedStep], graphs: bool
) -> list[float]:
    """``predicted / measured - 1`` per step, priced eagerly or with CUDA graphs."""
    cost = EngineCostModel(model, gpu, clock, cuda_graphs=graphs)
    return [cost.step_time_s(s.shape) / s.seconds - 1.0 for s in steps]


def host_features(shape: StepShape) -> list[float]:
    """What ``HOST_PARAMS`` multiply: 1, sequences, sequences x table width, new tokens (the
    width from the step's longest context, which a host-only step records)."""
    n, b = shape.num_seqs, max(1, shape.block_size)
    width = -(-longest_context_tokens(shape) // b)
    return [1.0, float(n), float(n * width), float(shape.num_batched_tokens)]


def fit_host(base: EngineClock, steps: Sequence[TimedStep]) -> EngineClock:
    """``base`` with ``HOST_PARAMS`` fitted to host-only steps (each must know its longest
    context): non-negative least squares of the relative error. ValueError otherwise."""
    import numpy as np
    from scipy.optimize import nnls

    if not steps or any(not longest_context_tokens(s.shape) for s in steps):
        raise ValueError("host-only steps must be timed, each with its longest context")
    seconds = np.array([s.seconds for s in steps])
    a = np.array([host_features(s.shape) for s in steps]) / seconds[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(a / scale, np.ones(len(steps)))
    values: dict[str, Any] = {n: float(v) for n, v in zip(HOST_PARAMS, x / scale, strict=True)}
    return replace(base, **values)


def fit_steps(
    base: EngineClock,
    model: ModelCost,
    gpu: GPUSpec,
    eager: Sequence[TimedStep],
    graphs: Sequence[TimedStep] = (),
    host_fixed: bool = False,
) -> EngineClock:
    """``base`` with ``STEP_PARAMS`` (and ``GRAPH_PARAMS`` when ``graphs`` holds steps) fitted
    to the timed steps; ``host_fixed``: ``HOST_PARAMS`` kept as ``base`` has them (fitted by
    ``fit_host``). ValueError without eager steps."""
    import numpy as np
    from scipy.optimize import least_squares

    if not eager:
        raise ValueError("no timed eager steps to fit")
    step_params = [n for n in STEP_PARAMS if not (host_fixed and n in HOST_PARAMS)]
    names = step_params + (list(GRAPH_PARAMS) if graphs else [])
    sets = [(list(eager), False), (list(graphs), True)]
    measured = np.array([s.seconds for steps, _ in sets for s in steps])

    def trial(x: np.ndarray) -> EngineClock:
        values: dict[str, Any] = {n: _from_x(n, float(v)) for n, v in zip(names, x, strict=True)}
        return replace(base, **values)

    def residuals(x: np.ndarray) -> np.ndarray:
        clock = trial(x)
        out = []
        for steps, graphed in sets:
            cost = EngineCostModel(model, gpu, clock, cuda_graphs=graphed)
            out += [cost.step_time_s(s.shape) for s in steps]
        return np.array(out) / measured - 1.0

    start = np.array([_to_x(n, STARTS[n]) for n in names])
    best = None
    for shift in (0.0, 0.7, -0.7, 1.5):
        x0 = start + shift * np.resize(np.array([1.0, -1.0, 1.0]), len(names))
        with np.errstate(over="ignore", invalid="ignore"):
            sol = least_squares(residuals, x0, loss="soft_l1", f_scale=0.05, diff_step=1e-3)
        if best is None or sol.cost < best.cost:
            best = sol
    assert best is not None
    return trial(best.x)


def _kind(step: TimedStep) -> str:
    s = step.shape
    if s.num_decode_seqs == s.num_seqs:
        return "decode"
    return "prefill" if s.num_decode_seqs == 0 else "mixed"


def step_report(
    clock: EngineClock, model: ModelCost, gpu: GPUSpec, steps: Sequence[TimedStep], graphs: bool
) -> dict[str, Any]:
    """Errors of the clock on ``steps`` by kind (prefill only, mixed, decode only): count,
    median and max of ``abs(predicted / measured - 1)``, and the error of their sum."""
    errs = step_errors(clock, model, gpu, steps, graphs)
    out: dict[str, Any] = {}
    for kind in ("prefill", "mixed", "decode"):
        mine = [abs(e) for e, s in zip(errs, steps, strict=True) if _kind(s) == kind]
        if mine:
            out[kind] = {
                "steps": len(mine),
                "median_rel_err": statistics.median(mine),
                "max_rel_err": max(mine),
            }
    total = sum(s.seconds for s in steps)
    out["sum_rel_err"] = (
        sum((1 + e) * s.seconds for e, s in zip(errs, steps, strict=True)) / total - 1
    )
    return out


def host_report(
    clock: EngineClock, model: ModelCost, gpu: GPUSpec, steps: Sequence[TimedStep]
) -> dict[str, Any]:
    """The host terms' errors on host-only steps, as ``step_report`` words them (one kind)."""
    cost = EngineCostModel(model, gpu, clock)
    errs = [cost.host_s(s.shape) / s.seconds - 1.0 for s in steps]
    total = sum(s.seconds for s in steps)
    predicted = sum((1 + e) * s.seconds for e, s in zip(errs, steps, strict=True))
    mags = [abs(e) for e in errs]
    return {
        "all": {
            "steps": len(steps),
            "median_rel_err": statistics.median(mags),
            "max_rel_err": max(mags),
        },
        "sum_rel_err": predicted / total - 1,
    }
