"""A step cost measured on a real engine: a linear model over ``StepShape`` fitted to timed
steps (``pagedkv profile``), read back from its JSON by ``load_cost_profile``.

    step_time_s = sum(coefficient[f] * feature_f(shape))   over the features below

The features are what one engine step pays for: a fixed cost per step (scheduling, launching
the forward pass, Python), each new token (the weight matmuls), each sequence (sampling,
detokenizing, per-sequence bookkeeping), each context token attended to (reading K and V),
each query-key pair (attention arithmetic, dominant in long prefills) and each KV block walked
(the block-table gather). The fit is a weighted least-squares with non-negative coefficients
(``fit_cost``): weighted by ``1 / seconds`` so that a 20 ms decode step counts as much as a 2 s
prefill, i.e. it minimises the *relative* error. Pure Python (no numpy, no torch): the
simulator package must stay importable without them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.sim.cost_model import StepShape

PROFILE_FORMAT = "pagedkv-cost-profile"
PROFILE_VERSION = 1

# coefficient name -> the StepShape field it multiplies (None: the constant 1 of every step)
FEATURES: dict[str, str | None] = {
    "per_step_s": None,
    "per_batched_token_s": "num_batched_tokens",
    "per_seq_s": "num_seqs",
    "per_kv_read_token_s": "kv_read_tokens",
    "per_attention_pair_s": "attention_pairs",
    "per_kv_block_s": "kv_blocks_read",
}
_SHAPE_FIELDS = tuple(f.name for f in fields(StepShape))


def features(shape: StepShape) -> list[float]:
    """The feature vector of ``shape``, in ``FEATURES`` order."""
    return [1.0 if name is None else float(getattr(shape, name)) for name in FEATURES.values()]


@dataclass(frozen=True)
class TimedStep:
    """One measured engine step: what it computed and how long it took (wall seconds)."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class ProfiledCostModel:
    """``CostModel`` from fitted coefficients (seconds per unit of each feature, all >= 0).
    ``source`` says where they came from (file, model, machine), for reports."""

    coefficients: dict[str, float]
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown cost coefficients {unknown} (known: {list(FEATURES)})")
        bad = {k: v for k, v in self.coefficients.items() if not (v >= 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"cost coefficients must be finite and >= 0, got {bad}")

    def step_time_s(self, shape: StepShape) -> float:
        c = self.coefficients
        t = sum(c.get(name, 0.0) * x for name, x in zip(FEATURES, features(shape), strict=True))
        return max(t, 1e-9)  # the CostModel contract: > 0 (a profile of all zeros is absurd)


@dataclass(frozen=True)
class FitStats:
    """How well the coefficients reproduce the samples they were fitted to. Relative errors
    are ``(predicted - measured) / measured`` per step; ``total_rel_error`` compares the sums
    (what a replay's total time feels)."""

    num_samples: int
    num_outliers: int  # samples left out of the fit (see ``fit_robust``)
    rms_rel_error: float
    median_abs_rel_error: float
    p90_abs_rel_error: float
    max_abs_rel_error: float
    total_rel_error: float


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


def fit_cost(samples: Sequence[TimedStep], names: Sequence[str] | None = None) -> ProfiledCostModel:
    """Fit the coefficients of ``names`` (default: every feature) to ``samples``; the other
    coefficients are 0. Minimises sum(((predicted - measured) / measured)^2) subject to every
    coefficient >= 0: solve, drop the most negative feature, solve again (an active-set pass
    that is exact whenever no dropped feature would come back, which holds for the well-spread
    samples ``pagedkv profile`` takes). Columns are scaled to unit norm first, so counts of
    10^6 query-key pairs and the constant 1 are solved with the same precision.
    ValueError with no samples or a non-positive time."""
    if not samples:
        raise ValueError("no timed steps to fit")
    if any(not (s.seconds > 0 and math.isfinite(s.seconds)) for s in samples):
        raise ValueError("every timed step must last a finite time > 0")
    all_names = list(FEATURES)
    active = [all_names.index(n) for n in (names or all_names)]
    # Weighted rows: x_i / y_i against 1 (relative error), one per sample.
    rows = [[x / s.seconds for x in features(s.shape)] for s in samples]
    while True:
        active = [j for j in active if any(r[j] for r in rows)]  # a feature never seen: 0
        norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) for j in active]
        cols = [[r[j] / nrm for r in rows] for j, nrm in zip(active, norms, strict=True)]
        gram = [[sum(p * q for p, q in zip(ci, cj, strict=True)) for cj in cols] for ci in cols]
        rhs = [sum(ci) for ci in cols]
        scaled = _solve(gram, rhs)
        if scaled is None:  # collinear features: drop the last one and retry
            active = active[:-1]
            continue
        coef = [x / nrm for x, nrm in zip(scaled, norms, strict=True)]
        worst = min(range(len(coef)), key=lambda k: coef[k], default=None)
        if worst is None or coef[worst] >= 0:
            break
        del active[worst]
    result = dict.fromkeys(all_names, 0.0)
    for j, c in zip(active, coef, strict=True):
        result[all_names[j]] = c
    return ProfiledCostModel(result)


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


@dataclass(frozen=True)
class CostProfile:
    """A profile as written to JSON: the fitted coefficients, their fit error, what was
    measured (``meta``: model, machine, threads, torch version, dtype, block sizes) and the
    raw samples (so another fit can be tried without measuring again)."""

    coefficients: dict[str, float]
    fit: FitStats
    meta: dict[str, Any]
    samples: tuple[TimedStep, ...]

    @classmethod
    def from_samples(cls, samples: Sequence[TimedStep], meta: dict[str, Any]) -> CostProfile:
        """Fit (``fit_robust``) and keep every sample, the left-out ones too."""
        model, kept = fit_robust(samples)
        stats = fit_stats(model, kept, len(samples) - len(kept))
        return cls(model.coefficients, stats, dict(meta), tuple(samples))

    def cost_model(self, source: str = "") -> ProfiledCostModel:
        return ProfiledCostModel(dict(self.coefficients), source or self.describe())

    def describe(self) -> str:
        m = self.meta
        return (
            f"profile of {m.get('model', '?')} on {m.get('machine', '?')} "
            f"({m.get('threads', '?')} threads, fit rms error {self.fit.rms_rel_error:.1%})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            **self.meta,
            "coefficients": self.coefficients,
            "fit": asdict(self.fit),
            "samples": [{**asdict(s.shape), "seconds": s.seconds} for s in self.samples],
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _number(value: Any, where: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise UsageError(f"{where} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def parse_cost_profile(data: Any, source: str) -> CostProfile:
    """A ``CostProfile`` from parsed JSON; ``UsageError`` starting with ``source`` for anything
    that is not a version-1 pagedkv cost profile."""
    try:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise UsageError(f'not a pagedkv cost profile (no "format": "{PROFILE_FORMAT}")')
        if data.get("version") != PROFILE_VERSION:
            raise UsageError(
                f"cost profile version {data.get('version')!r} is not supported "
                f"(this pagedkv reads version {PROFILE_VERSION}; run pagedkv profile again)"
            )
        for key in ("coefficients", "fit", "samples"):
            if key not in data:
                raise UsageError(f"missing key {key!r}")
        coeffs = data["coefficients"]
        if not isinstance(coeffs, dict):
            raise UsageError("'coefficients' must be an object")
        unknown = sorted(set(coeffs) - set(FEATURES))
        missing = sorted(set(FEATURES) - set(coeffs))
        if unknown or missing:
            raise UsageError(
                f"coefficients: unknown {unknown}, missing {missing} (expected {list(FEATURES)})"
            )
        coefficients = {k: _number(coeffs[k], f"coefficients.{k}") for k in FEATURES}
        try:
            fit = FitStats(**data["fit"])
        except TypeError:
            names = [f.name for f in fields(FitStats)]
            raise UsageError(f"'fit' must be an object of exactly {names}") from None
        if not isinstance(data["samples"], list):
            raise UsageError("'samples' must be a list")
        samples = tuple(_sample(s, i) for i, s in enumerate(data["samples"]))
    except UsageError as exc:
        raise UsageError(f"{source}: {exc}") from None
    meta = {k: v for k, v in data.items() if k not in ("coefficients", "fit", "samples")}
    return CostProfile(coefficients, fit, meta, samples)


def _sample(record: Any, index: int) -> TimedStep:
    where = f"samples[{index}]"
    if not isinstance(record, dict) or set(record) != {*_SHAPE_FIELDS, "seconds"}:
        raise UsageError(f"{where} must hold exactly {[*_SHAPE_FIELDS, 'seconds']}")
    shape = StepShape(**{k: int(_number(record[k], f"{where}.{k}")) for k in _SHAPE_FIELDS})
    return TimedStep(shape, _number(record["seconds"], f"{where}.seconds"))


def read_cost_profile(path: str | Path) -> CostProfile:
    """The profile in ``path``; ``UsageError`` naming the file when it is missing, not JSON,
    or not a cost profile this version reads."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UsageError(f"cannot read cost profile {str(path)!r}: {reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{path}:{exc.lineno}: not JSON ({exc.msg}); expected a pagedkv cost profile"
        ) from None
    return parse_cost_profile(data, str(path))


def load_cost_profile(path: str | Path) -> ProfiledCostModel:
    """The ``CostModel`` of the profile in ``path`` (``pagedkv simulate --cost-profile``).
    ``UsageError`` naming the file for a missing file, bad JSON or a foreign/old profile."""
    profile = read_cost_profile(path)
    return profile.cost_model(f"{path}: {profile.describe()}")
