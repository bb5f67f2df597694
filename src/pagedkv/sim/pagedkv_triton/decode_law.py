"""Paged decode attention of pagedkv's own Triton kernel: candidate laws in the block size B,
priced per layer call, fitted to the device check's ledger rows; the data chooses the law.

The kernel (``model/triton/decode.py``, ``decode_split.py``) runs one program per (sequence,
KV head, split); a program walks its part of the context one block per loop iteration: read
the block id from the table, load the block's K and V (``B`` tokens of one head), one
``tl.dot`` each, an online-softmax update. The candidates (``LAWS``) differ in what a block
costs:

- ``walk``: an iteration is a dependent chain, ``iter_s + iter_per_byte_s * block bytes``, and
  the GPU keeps ``resident_per_sm * num_sms`` programs in flight, so a launch of ``P``
  programs, each ``c`` blocks long, lasts ``c * iteration * max(1, P / resident)``; beside the
  bandwidth floor ``KV bytes / (BW * bw_eff)`` (soft maximum, knee 4). Small blocks carry too
  few bytes per iteration to keep memory busy: B = 16 is latency-bound. In a batch of unequal
  contexts (a real step) the launch lasts until its longest program ends: programs start in
  order as slots free up (list scheduling), so the mean walk above is followed by what the
  longest chain ``c_max`` has beyond the mean one, ``(c_max - c) * iteration``: exact for one
  wave (every program starts at once and the longest ends last); against a brute-force list
  schedule of the H200 check's run steps on the fitted law, a median of -4 % (244 x 840
  tokens, longest 2,087: 385 us against 401), at worst -37 % where a batch barely exceeds one
  wave of nearly equal contexts (its last ten steps: the late programs start after one whole
  chain, not a fraction of one). The ledger's rows have equal contexts, where the term is 0:
  it adds no parameter.
- ``overhead``: the law the vLLM-class clock assumes (``sim/vllm_class/cost.block_walk_factor``):
  the bandwidth time times ``1 + overhead_at_16 * 16 / B``.
- ``bandwidth``: the bandwidth time alone (whole blocks read, no per-block cost).

Every law adds ``launch_s`` and, when the context is split, ``split_s`` (the second launch
that combines the parts). ``fit_law`` fits one law; ``choose_law`` fits all of them, scores
each by leave-one-context-out cross-validation (fit without every row of one context length,
price those rows) and keeps the law with the least median error there. numpy and scipy are
imported only when fitting.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.vllm_class.clock import soft_max

KNEE = 4.0  # soft maximum of the walk and the bandwidth floor (as gpu_clock's decode)

# law -> its parameters, in fit order, with the starting values of a fit
LAWS: dict[str, dict[str, float]] = {
    "walk": {
        "launch_s": 5e-6,
        "split_s": 5e-6,
        "iter_s": 1e-6,
        "iter_per_byte_s": 1e-13,
        "resident_per_sm": 3.0,
        "bw_eff": 0.9,
    },
    "overhead": {"launch_s": 5e-6, "split_s": 5e-6, "bw_eff": 0.9, "overhead_at_16": 0.2},
    "bandwidth": {"launch_s": 5e-6, "split_s": 5e-6, "bw_eff": 0.9},
}


@dataclass(frozen=True)
class DecodeCall:
    """One paged decode launch (one layer): ``batch`` sequences of ``context_tokens`` each (a
    mean, in a step of mixed lengths) in blocks of ``block_size``, cut into ``num_splits``
    parts, ``kv_heads`` KV heads of ``head_dim`` values of ``element_bytes`` each;
    ``longest_tokens``: the longest sequence's context (0: every context is the mean)."""

    batch: int
    context_tokens: float
    block_size: int
    num_splits: int
    kv_heads: int
    head_dim: int
    element_bytes: int = 2
    longest_tokens: float = 0.0

    @property
    def blocks_per_seq(self) -> int:
        return max(1, math.ceil(self.context_tokens / self.block_size))

    @property
    def longest_blocks(self) -> int:
        """Blocks of the longest sequence (never fewer than the mean's)."""
        return max(self.blocks_per_seq, math.ceil(self.longest_tokens / self.block_size))

    @property
    def block_bytes(self) -> int:
        """K and V of one block of one head."""
        return 2 * self.block_size * self.head_dim * self.element_bytes


@dataclass(frozen=True)
class LedgerRow:
    """A measured call: its shape and the median seconds the device check timed."""

    call: DecodeCall
    seconds: float


def check_params(law: str, params: Mapping[str, float]) -> None:
    """ValueError unless ``law`` is known and ``params`` holds exactly its finite, > 0 values
    (launch and split costs may be 0)."""
    if law not in LAWS:
        raise ValueError(f"unknown decode law {law!r} (known: {', '.join(LAWS)})")
    if set(params) != set(LAWS[law]):
        raise ValueError(f"decode law {law!r} takes {sorted(LAWS[law])}, got {sorted(params)}")
    for name, value in params.items():
        low_ok = value >= 0 if name in ("launch_s", "split_s") else value > 0
        if not (isinstance(value, (int, float)) and math.isfinite(value) and low_ok):
            raise ValueError(f"decode law {law!r}: {name} must be finite and > 0, got {value!r}")


def decode_call_s(law: str, params: Mapping[str, float], gpu: GPUSpec, call: DecodeCall) -> float:
    """Seconds of one decode launch under ``law`` (module docstring)."""
    p = params
    blocks = call.blocks_per_seq
    kv_bytes = call.batch * call.kv_heads * blocks * call.block_bytes
    bandwidth_s = kv_bytes / (gpu.mem_bandwidth_bytes_per_s * p["bw_eff"])
    fixed = p["launch_s"] + (p["split_s"] if call.num_splits > 1 else 0.0)
    if law == "bandwidth":
        return fixed + bandwidth_s
    if law == "overhead":
        return fixed + bandwidth_s * (1.0 + p["overhead_at_16"] * 16.0 / call.block_size)
    programs = call.batch * call.kv_heads * call.num_splits
    chain = math.ceil(blocks / call.num_splits)
    tail = math.ceil(call.longest_blocks / call.num_splits) - chain  # the longest beyond the mean
    iteration_s = p["iter_s"] + p["iter_per_byte_s"] * call.block_bytes
    waves = max(1.0, programs / (p["resident_per_sm"] * gpu.num_sms))
    return fixed + soft_max((chain * waves + tail) * iteration_s, bandwidth_s, KNEE)


def token_cost_ratio(
    law: str, params: Mapping[str, float], block_size: int, ref_block_size: int
) -> float:
    """What one KV token costs a long walk at ``block_size`` relative to ``ref_block_size``,
    with the head dim of 128 and bf16 values the ledger measured: the factor the prefill
    kernel's fitted per-token costs (measured at one block size) are scaled by at another."""
    if law == "bandwidth":
        return 1.0
    if law == "overhead":
        f = params["overhead_at_16"]
        return (1.0 + f * 16.0 / block_size) / (1.0 + f * 16.0 / ref_block_size)

    def per_token(b: int) -> float:
        return (params["iter_s"] + params["iter_per_byte_s"] * 2 * b * 128 * 2) / b

    return per_token(block_size) / per_token(ref_block_size)


def relative_errors(
    law: str, params: Mapping[str, float], gpu: GPUSpec, rows: Sequence[LedgerRow]
) -> list[float]:
    """``predicted / measured - 1`` per row."""
    return [decode_call_s(law, params, gpu, r.call) / r.seconds - 1.0 for r in rows]


def fit_law(law: str, rows: Sequence[LedgerRow], gpu: GPUSpec) -> dict[str, float]:
    """The parameters of ``law`` that fit ``rows`` (measured on ``gpu``): least squares of the
    relative error over the parameters' logarithms (all stay > 0), soft-L1 loss (a row timed
    in a bad moment must not bend the law), from a few spread starts (the walk's max and
    waves have kinks); the best optimum. ValueError with no rows."""
    import numpy as np
    from scipy.optimize import least_squares

    if not rows:
        raise ValueError("no ledger rows to fit")
    names = list(LAWS[law])
    measured = np.array([r.seconds for r in rows])

    def residuals(x: np.ndarray) -> np.ndarray:
        trial = dict(zip(names, np.exp(x), strict=True))
        return np.array([decode_call_s(law, trial, gpu, r.call) for r in rows]) / measured - 1

    start = np.log([LAWS[law][n] for n in names])
    best = None
    for shift in (0.0, 1.0, -1.0, 2.0):
        x0 = start + shift * np.resize(np.array([1.0, -1.0]), len(names))
        with np.errstate(over="ignore"):
            sol = least_squares(residuals, x0, loss="soft_l1", f_scale=0.05, diff_step=1e-3)
        if best is None or sol.cost < best.cost:
            best = sol
    assert best is not None
    return {n: float(v) for n, v in zip(names, np.exp(best.x), strict=True)}


@dataclass(frozen=True)
class LawScore:
    """One law fitted to every row, its in-sample errors (``abs``) and its errors on each
    context left out (None with fewer than two contexts)."""

    law: str
    params: dict[str, float]
    median_err: float
    p90_err: float
    max_err: float
    loco_median_err: float | None
    loco_p90_err: float | None


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def score_law(law: str, rows: Sequence[LedgerRow], gpu: GPUSpec) -> LawScore:
    params = fit_law(law, rows, gpu)
    errs = [abs(e) for e in relative_errors(law, params, gpu, rows)]
    contexts = sorted({r.call.context_tokens for r in rows})
    loco: list[float] = []
    if len(contexts) > 1:
        for context in contexts:
            train = [r for r in rows if r.call.context_tokens != context]
            test = [r for r in rows if r.call.context_tokens == context]
            held = fit_law(law, train, gpu)
            loco += [abs(e) for e in relative_errors(law, held, gpu, test)]
    return LawScore(
        law,
        params,
        statistics.median(errs),
        _quantile(errs, 0.9),
        max(errs),
        statistics.median(loco) if loco else None,
        _quantile(loco, 0.9) if loco else None,
    )


def choose_law(rows: Sequence[LedgerRow], gpu: GPUSpec) -> tuple[LawScore, list[LawScore]]:
    """Every law scored (``score_law``) and the chosen one: the least leave-one-context-out
    median error (the in-sample median when the rows hold one context only)."""
    scores = [score_law(law, rows, gpu) for law in LAWS]

    def key(s: LawScore) -> float:
        return s.loco_median_err if s.loco_median_err is not None else s.median_err

    return min(scores, key=key), scores
