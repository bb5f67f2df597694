"""A step cost measured on a real engine: a linear model over ``StepShape`` fitted to timed
steps (``pagedkv profile``, fitted by ``sim/costs/profile_fit.py``), read back from its JSON by
``load_cost_profile``.

    step_time_s = sum(coefficient[f] * feature_f(shape)) + token_offset_s(num_batched_tokens)

The features are what one engine step pays for: a fixed cost per step (scheduling, launching
the forward pass, Python), each new token (the weight matmuls), each sequence (sampling,
detokenizing, per-sequence bookkeeping), each context token attended to (reading K and V),
each query-key pair (attention arithmetic, dominant in long prefills) and each KV block walked
(the block-table gather). ``token_offsets_s`` correct the line for steps of few new tokens,
where the matmul library picks other kernels (on the 2-core AMD EPYC machine of this project,
2 and 3 rows ran ~40 ms slower than the line through 1 and 4 rows): seconds added per token
count, interpolated between the counts measured, 0 outside them. Pure Python (no numpy,
no torch): the simulator package must stay importable without them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.sched.step_shape import StepShape, TimedStep

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
class ProfiledCostModel:
    """``CostModel`` from fitted coefficients (seconds per unit of each feature, all >= 0).
    ``source`` says where they came from (file, model, machine), for reports."""

    coefficients: dict[str, float]
    token_offsets_s: dict[int, float] = field(default_factory=dict)  # signed
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        bad_offsets = {
            k: v
            for k, v in self.token_offsets_s.items()
            if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not math.isfinite(v)
        }
        if bad_offsets:
            raise ValueError(f"token offsets need counts >= 1 and finite seconds: {bad_offsets}")
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown cost coefficients {unknown} (known: {list(FEATURES)})")
        bad = {k: v for k, v in self.coefficients.items() if not (v >= 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"cost coefficients must be finite and >= 0, got {bad}")

    def step_time_s(self, shape: StepShape) -> float:
        c = self.coefficients
        t = sum(c.get(name, 0.0) * x for name, x in zip(FEATURES, features(shape), strict=True))
        t += self.token_offset_s(shape.num_batched_tokens)
        return max(t, 1e-9)  # the CostModel contract: > 0 (a profile of all zeros is absurd)

    def token_offset_s(self, num_tokens: int) -> float:
        """The fitted offset at ``num_tokens``, linear between fitted counts, 0 outside."""
        f = self.token_offsets_s
        if not f or num_tokens > max(f) or num_tokens < min(f):
            return 0.0
        if num_tokens in f:
            return f[num_tokens]
        lo = max(k for k in f if k < num_tokens)
        hi = min(k for k in f if k > num_tokens)
        return f[lo] + (f[hi] - f[lo]) * (num_tokens - lo) / (hi - lo)


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


@dataclass(frozen=True)
class CostProfile:
    """A profile as written to JSON: the fitted coefficients, their fit error, what was
    measured (``meta``: model, machine, threads, torch version, dtype, block sizes) and the
    raw samples (so another fit can be tried without measuring again). Built from samples by
    ``profile_fit.build_profile``."""

    model: ProfiledCostModel
    fit: FitStats
    meta: dict[str, Any]
    samples: tuple[TimedStep, ...]

    def cost_model(self, source: str = "") -> ProfiledCostModel:
        m = self.model
        return ProfiledCostModel(m.coefficients, m.token_offsets_s, source or self.describe())

    def describe(self) -> str:
        """One line: the model, what it ran on (the GPU for a device profile, the host CPU
        named beside it; the CPU and its threads otherwise) and the fit's error."""
        m = self.meta
        device = str(m.get("device", ""))
        if "cuda" in device:  # "device cuda:0 (NVIDIA H200), bfloat16, attention triton"
            where = f"{device.removeprefix('device ')}; host {m.get('machine', '?')}"
        else:
            where = f"{m.get('machine', '?')} ({m.get('threads', '?')} thread(s)"
            where += f", {m.get('clock', 'wall')} clock)"
        return (
            f"profile of {m.get('model', '?')} on {where} (fit rms error "
            f"{self.fit.rms_rel_error:.1%} over {self.fit.num_samples} steps)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            **self.meta,
            "coefficients": self.model.coefficients,
            "token_offsets_s": {str(k): v for k, v in sorted(self.model.token_offsets_s.items())},
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
        for key in _DATA_KEYS:
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
        token_offsets = _token_offsets(data["token_offsets_s"])
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
    meta = {k: v for k, v in data.items() if k not in _DATA_KEYS}
    return CostProfile(ProfiledCostModel(coefficients, token_offsets), fit, meta, samples)


_DATA_KEYS = ("coefficients", "token_offsets_s", "fit", "samples")


def _token_offsets(record: Any) -> dict[int, float]:
    if not isinstance(record, dict):
        raise UsageError("'token_offsets_s' must be an object {token count: seconds}")
    out = {}
    for key, value in record.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 1):
            raise UsageError(f"token_offsets_s: {key!r} is not a token count >= 1")
        out[int(key)] = _number(value, f"token_offsets_s.{key}", -math.inf)
    return out


def _sample(record: Any, index: int) -> TimedStep:
    where = f"samples[{index}]"
    # decode_kv_tokens came later: a profile written before it still reads (as 0)
    required = {*_SHAPE_FIELDS, "seconds"} - {"decode_kv_tokens"}
    if not isinstance(record, dict) or not required <= set(record) <= {*required, *_SHAPE_FIELDS}:
        raise UsageError(f"{where} must hold exactly {[*_SHAPE_FIELDS, 'seconds']}")
    present = [k for k in _SHAPE_FIELDS if k in record]
    shape = StepShape(**{k: int(_number(record[k], f"{where}.{k}")) for k in present})
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
