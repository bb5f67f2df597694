"""Fitting a ``GPUClock`` to measured op times (``pagedkv calibrate``), and its JSON file.

Each op family is fitted on its own rows (the families share no parameter): a robust
nonlinear least-squares over the logarithms of the family's parameters (so every one stays
> 0), minimising the *relative* error ``predicted / measured - 1`` with a soft-L1 loss (a few
rows that the profiler caught in a bad moment must not bend the curve). A family with no rows
keeps the ``base`` clock's numbers, and the file says where they came from. Each fitted
parameter carries its relative uncertainty (one sigma, from the Jacobian at the optimum), which
``benchmarks/clock_vs_measured.py --sensitivity`` turns into step-time ranges.

numpy and scipy are imported only here and only when fitting (``pip install
'pagedkv[calibrate]'``); reading a clock file needs neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError, read_json
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.vllm_class.clock import ELEMENTWISE_OPS, GPUClock, KernelPrice
from pagedkv.sim.vllm_class.data import FAMILIES, OpRow, price

CLOCK_FORMAT = "pagedkv-gpu-clock"
CLOCK_VERSION = 1
# family -> the GPUClock fields it fits ("elementwise:<op>:<field>" for the per-op prices)
PARAMS: dict[str, tuple[str, ...]] = {
    "gemm": ("gemm_launch_s", "gemm_bw_eff", "gemm_flops_eff", "gemm_knee"),
    "decode_attention": (
        "decode_launch_s",
        "decode_split_s",
        "decode_bw_eff",
        "decode_tile_eff",
        "decode_per_seq_s",
    ),
    "prefill_attention": ("prefill_launch_s", "prefill_split_s", "prefill_tile_eff"),
    "step_overhead": ("step_base_s", "step_per_seq_s", "step_per_worker_s"),
}


NUM_EXTRA_STARTS = 6
# log-space offsets of the starts (the first is the base itself); cycled over the parameters
_START_SHIFTS = (
    (0.0,),
    (1.5, -1.5),
    (-1.5, 1.5),
    (1.5, 1.5, -1.5),
    (-1.5, -1.5, 1.5),
    (2.5, 0.0),
    (0.0, 2.5),
)


def get_param(clock: GPUClock, name: str) -> float:
    if name.startswith("elementwise:"):
        _, op, attr = name.split(":")
        return float(getattr(clock.elementwise[op], attr))
    return float(getattr(clock, name))


def with_params(clock: GPUClock, values: dict[str, float]) -> GPUClock:
    """``clock`` with the named parameters replaced."""
    plain = {k: v for k, v in values.items() if not k.startswith("elementwise:")}
    prices = dict(clock.elementwise)
    for name, v in values.items():
        if name.startswith("elementwise:"):
            _, op, attr = name.split(":")
            prices[op] = replace(prices[op], **{attr: v})
    return replace(clock, **plain, elementwise=prices)


def _groups(rows: Sequence[OpRow]) -> list[tuple[str, tuple[str, ...], list[OpRow]]]:
    """(label, parameters, rows) of each independent fit."""
    out = []
    for family, names in PARAMS.items():
        mine = [r for r in rows if r.family == family]
        if mine:
            out.append((family, names, mine))
    for op in ELEMENTWISE_OPS:
        mine = [r for r in rows if r.family == "elementwise" and r.op == op]
        if mine:
            out.append(
                (
                    f"elementwise:{op}",
                    (f"elementwise:{op}:launch_s", f"elementwise:{op}:bw_eff"),
                    mine,
                )
            )
    return out


def fit_clock(
    rows: Sequence[OpRow],
    gpu: GPUSpec,
    base: GPUClock | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[GPUClock, dict[str, float]]:
    """The clock that fits ``rows`` (all measured on ``gpu``), starting from ``base`` (whose
    numbers families without rows keep), and each fitted parameter's relative sigma.
    ``progress`` hears one line per fit as it starts."""
    import numpy as np
    from scipy.optimize import least_squares

    clock = base or GPUClock()
    sigmas: dict[str, float] = {}
    for label, names, group in _groups(rows):
        if progress is not None:
            progress(f"fitting {label} ({len(group):,} rows, {len(names)} parameters)")
        measured = np.array([r.measured_s for r in group])
        start = np.log([max(get_param(clock, n), 1e-9) for n in names])

        def residuals(x, names=names, group=group, measured=measured, clock=clock):
            trial = with_params(clock, dict(zip(names, np.exp(x), strict=True)))
            return np.array([price(r, trial, gpu) for r in group]) / measured - 1.0

        # The prices have kinks (a max, whole waves, a split or none), so a start can slide
        # into a corner where one term never binds: start from the base and from a fixed set
        # of spread-out points, keep the best optimum.
        sol = None
        for shift in _START_SHIFTS[: 1 + NUM_EXTRA_STARTS]:
            x0 = start + np.resize(np.array(shift), len(names))
            with np.errstate(over="ignore"):  # a far start overflows a square: a worse trial
                trial = least_squares(residuals, x0, loss="soft_l1", f_scale=0.05, diff_step=1e-3)
            if sol is None or trial.cost < sol.cost:
                sol = trial
        assert sol is not None  # _START_SHIFTS is not empty: at least one start ran
        clock = with_params(clock, dict(zip(names, map(float, np.exp(sol.x)), strict=True)))
        dof = max(1, len(group) - len(names))
        s2 = float(np.sum(sol.fun**2)) / dof
        try:
            cov = np.linalg.pinv(sol.jac.T @ sol.jac) * s2
            diag = np.sqrt(np.clip(np.diag(cov), 0, None))
        except np.linalg.LinAlgError:
            diag = np.full(len(names), math.inf)
        # a log-parameter's sigma is the parameter's relative sigma (to first order)
        sigmas.update({n: float(s) for n, s in zip(names, diag, strict=True)})
    return clock, sigmas


def errors(rows: Sequence[OpRow], clock: GPUClock, gpu: GPUSpec) -> list[float]:
    """``predicted / measured - 1`` per row."""
    return [price(r, clock, gpu) / r.measured_s - 1.0 for r in rows]


def summarize_errors(rel: Sequence[float]) -> dict[str, float | int]:
    ordered = sorted(abs(e) for e in rel)
    n = len(ordered)
    return {
        "rows": n,
        "median_rel_err": ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2,
        "p95_rel_err": ordered[min(n - 1, math.ceil(0.95 * n) - 1)],
        "max_rel_err": ordered[-1],
    }


def clock_to_dict(clock: GPUClock, gpu: GPUSpec, meta: dict[str, Any]) -> dict[str, Any]:
    params = asdict(clock)
    return {
        "format": CLOCK_FORMAT,
        "version": CLOCK_VERSION,
        "gpu": gpu.name,
        **meta,
        "params": params,
    }


def write_clock(path: str | Path, clock: GPUClock, gpu: GPUSpec, meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(clock_to_dict(clock, gpu, meta), indent=1) + "\n")


def parse_clock(data: Any, source: str) -> tuple[GPUClock, dict[str, Any]]:
    """The clock and the rest of the record; UsageError naming ``source`` otherwise."""
    if not isinstance(data, dict) or data.get("format") != CLOCK_FORMAT:
        raise UsageError(f'{source}: not a pagedkv GPU clock (no "format": "{CLOCK_FORMAT}")')
    if data.get("version") != CLOCK_VERSION:
        raise UsageError(f"{source}: clock version {data.get('version')!r} is not supported")
    params = data.get("params")
    if not isinstance(params, dict) or not isinstance(params.get("elementwise"), dict):
        raise UsageError(f"{source}: 'params' must be an object with 'elementwise' prices")
    try:
        prices = {op: KernelPrice(**p) for op, p in params["elementwise"].items()}
        clock = GPUClock(**{**params, "elementwise": prices})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{source}: bad clock parameters ({exc})") from None
    return clock, {k: v for k, v in data.items() if k != "params"}


def read_clock(path: str | Path) -> tuple[GPUClock, dict[str, Any]]:
    return parse_clock(read_json(path, "GPU clock"), str(path))


__all__ = ["FAMILIES", "fit_clock", "read_clock", "write_clock", "errors", "summarize_errors"]
