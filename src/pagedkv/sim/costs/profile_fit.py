"""Fitting a ``ProfiledCostModel`` to timed engine steps (``pagedkv profile``).

One weighted least-squares problem: the line's coefficients (kept >= 0) and one signed offset
per count of new tokens up to ``TOKEN_OFFSET_MAX_TOKENS`` that at least two steps show. Rows
are weighted by ``1 / seconds`` so that a 60 ms decode step counts as much as a 2 s prefill,
i.e. the fit minimises the *relative* error. Steps that another process disturbed (the
machines are shared) are left out and the fit repeated (``fit_robust``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagedkv.sched.step_shape import TimedStep
from pagedkv.sim.costs.profiled import FEATURES, CostProfile, FitStats, ProfiledCostModel, features

# Token counts that may get an offset of their own: the matmul kernels change with the row
# count only for a few rows; beyond this the line holds.
TOKEN_OFFSET_MAX_TOKENS = 16


def fit_stats(
    model: ProfiledCostModel, samples: Sequence[TimedStep], num_outliers: int = 0
) -> FitStats:
    """The errors of ``model`` on ``samples`` (the kept ones; ``num_outliers`` is recorded)."""
    rel = [(model.step_time_s(s.shape) - s.seconds) / s.seconds for s in samples]
    ordered = sorted(abs(r) for r in rel)
    n = len(rel)
    total = sum(s.seconds for s in samples)
    predicted = sum(model.step_time_s(s.shape) for s in samples)
    return FitStats(
        num_samples=n,
        num_outliers=num_outliers,
        rms_rel_error=math.sqrt(sum(r * r for r in rel) / n),
        median_abs_rel_error=ordered[n // 2],
        p90_abs_rel_error=ordered[min(n - 1, int(0.9 * n))],
        max_abs_rel_error=ordered[-1],
        total_rel_error=predicted / total - 1.0,
    )


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if ``a`` is (numerically) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit_cost(samples: Sequence[TimedStep], offsets: bool = True) -> ProfiledCostModel:
    """Minimise sum(((predicted - measured) / measured)^2) over ``samples``: every line
    coefficient >= 0 (solve, drop the most negative one, solve again: an active-set pass that
    is exact whenever no dropped feature would come back, which holds for the well-spread
    samples ``pagedkv profile`` takes) and, when ``offsets`` and there are twice as many
    samples as unknowns, a signed offset per small token count seen twice or more. Columns are scaled to unit norm first, so counts of 10^6
    query-key pairs and the constant 1 are solved with the same precision.
    ValueError with no samples or a non-positive time."""
    if not samples:
        raise ValueError("no timed steps to fit")
    if any(not (s.seconds > 0 and math.isfinite(s.seconds)) for s in samples):
        raise ValueError("every timed step must last a finite time > 0")
    seen: dict[int, int] = {}
    for s in samples:
        seen[s.shape.num_batched_tokens] = seen.get(s.shape.num_batched_tokens, 0) + 1
    counts = sorted(n for n, k in seen.items() if k >= 2 and n <= TOKEN_OFFSET_MAX_TOKENS)
    # An offset per count only with twice as many steps as unknowns: a tiny grid (--quick)
    # would otherwise be fitted exactly, noise included.
    enough = len(samples) >= 2 * (len(FEATURES) + len(counts))
    counts = counts if offsets and enough else []
    names = [*FEATURES, *counts]  # str: a line coefficient; int: the offset at that count
    rows = [
        [x / s.seconds for x in features(s.shape)]
        + [float(s.shape.num_batched_tokens == n) / s.seconds for n in counts]
        for s in samples
    ]
    active = list(range(len(names)))
    while True:
        active = [j for j in active if any(r[j] for r in rows)]  # a feature never seen: 0
        norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) for j in active]
        cols = [[r[j] / nrm for r in rows] for j, nrm in zip(active, norms, strict=True)]
        gram = [[sum(p * q for p, q in zip(ci, cj, strict=True)) for cj in cols] for ci in cols]
        scaled = _solve(gram, [sum(ci) for ci in cols])
        if scaled is None:  # collinear columns: drop the last one and retry
            active = active[:-1]
            continue
        coef = [x / nrm for x, nrm in zip(scaled, norms, strict=True)]
        line = [k for k, j in enumerate(active) if isinstance(names[j], str)]
        worst = min(line, key=lambda k: coef[k], default=None)
        if worst is None or coef[worst] >= 0:
            break
        del active[worst]
    fitted = dict(zip((names[j] for j in active), coef, strict=True))
    return ProfiledCostModel(
        {name: fitted.get(name, 0.0) for name in FEATURES},
        {n: fitted[n] for n in counts if n in fitted},
    )


def fit_robust(samples: Sequence[TimedStep]) -> tuple[ProfiledCostModel, list[TimedStep]]:
    """``fit_cost`` once, leave out the steps it misses by more than max(3x the median
    relative error, 15 %), fit again: a step that another process slowed down (the machines
    are shared) must not bend the coefficients. Returns the model and the steps kept."""
    model = fit_cost(samples)
    errors = [abs(model.step_time_s(s.shape) - s.seconds) / s.seconds for s in samples]
    limit = max(3 * sorted(errors)[len(errors) // 2], 0.15)
    kept = [s for s, e in zip(samples, errors, strict=True) if e <= limit]
    if len(kept) == len(samples) or len(kept) < len(FEATURES):
        return model, list(samples)
    return fit_cost(kept), kept


def build_profile(samples: Sequence[TimedStep], meta: dict[str, Any]) -> CostProfile:
    """Fit ``samples`` (``fit_robust``) into a profile that keeps every one of them."""
    model, kept = fit_robust(samples)
    stats = fit_stats(model, kept, len(samples) - len(kept))
    return CostProfile(model, stats, dict(meta), tuple(samples))
