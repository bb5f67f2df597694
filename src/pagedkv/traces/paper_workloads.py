"""The PagedAttention paper's workloads: ShareGPT-like and Alpaca-like requests, Poisson arrivals.

    requests = paper_workload("sharegpt", num_requests=500, rate_per_s=2.0, seed=0)

The vLLM paper (Kwon et al., SOSP 2023, §6.1 and Fig. 11) tokenizes the ShareGPT and Alpaca
datasets and states their mean lengths: ShareGPT 161.31 input / 337.99 output tokens, Alpaca
19.31 / 58.45; arrivals are Poisson at a given request rate. The paper gives only the means
and histograms, not the datasets' shapes, so the shape here is an **assumption**: each length
is log-normal (right-skewed like the histograms), rounded, clipped to ``[1, max]``, with the
log-scale spread ``sigma`` below and the location solved so that the *clipped* distribution has
exactly the paper's mean. The cap keeps prompt + output within OPT's 2,048-token context
(input <= 1,024 and output <= 1,024, the shape of vLLM's own ShareGPT benchmark filter).

Every request gets fresh prompt segments: these traces share no prefixes (the paper's
"basic sampling" runs). Deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.traces.segments import FreshSegments, TraceRequest


@dataclass(frozen=True)
class LogNormalLength:
    """A token count: round(X) clipped to ``[1, max_tokens]``, X log-normal with log-scale
    spread ``sigma``, located so that the clipped mean is ``mean_tokens``."""

    mean_tokens: float
    sigma: float
    max_tokens: int

    def __post_init__(self) -> None:
        if not 1 < self.mean_tokens < self.max_tokens or not self.sigma > 0:
            raise ValueError(f"bad length distribution {self}")

    @property
    def mu(self) -> float:
        """The log-scale location whose clipped mean is ``mean_tokens`` (bisection: the clipped
        mean rises monotonically with mu)."""
        lo, hi = -20.0, math.log(self.max_tokens) + 10 * self.sigma
        for _ in range(100):
            mid = (lo + hi) / 2
            if clipped_lognormal_mean(mid, self.sigma, 1, self.max_tokens) < self.mean_tokens:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def sample(self, rng: random.Random, mu: float) -> int:
        return min(self.max_tokens, max(1, round(rng.lognormvariate(mu, self.sigma))))


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[min(max(X, low), high)] for X = exp(N(mu, sigma^2)), in closed form."""
    a, c = math.log(low), math.log(high)
    below = low * _phi((a - mu) / sigma)
    above = high * (1 - _phi((c - mu) / sigma))
    inside = math.exp(mu + sigma**2 / 2) * (
        _phi((c - mu - sigma**2) / sigma) - _phi((a - mu - sigma**2) / sigma)
    )
    return below + inside + above


@dataclass(frozen=True)
class PaperWorkload:
    """One dataset's length model; ``source`` says where the means come from."""

    name: str
    input_tokens: LogNormalLength
    output_tokens: LogNormalLength
    source: str


_PAPER = "vLLM paper (Kwon et al., SOSP 2023) §6.1, Fig. 11"
# sigma: assumed (the paper shows histograms only). ShareGPT's lengths spread over two orders
# of magnitude (conversations); Alpaca's are short instructions with a shorter tail.
WORKLOADS: dict[str, PaperWorkload] = {
    w.name: w
    for w in (
        PaperWorkload(
            "sharegpt",
            LogNormalLength(161.31, 1.0, 1024),
            LogNormalLength(337.99, 1.0, 1024),
            f"{_PAPER}: mean input 161.31, output 337.99 tokens",
        ),
        PaperWorkload(
            "alpaca",
            LogNormalLength(19.31, 0.6, 1024),
            LogNormalLength(58.45, 0.9, 1024),
            f"{_PAPER}: mean input 19.31, output 58.45 tokens",
        ),
    )
}


def get_workload(name: str) -> PaperWorkload:
    """The workload called ``name`` (case-insensitive); UsageError naming the known ones."""
    workload = WORKLOADS.get(name.lower())
    if workload is None:
        raise UsageError(f"unknown paper workload {name!r} (known: {', '.join(WORKLOADS)})")
    return workload


def paper_workload(
    name: str, num_requests: int, rate_per_s: float, seed: int = 0
) -> list[TraceRequest]:
    """``num_requests`` requests of workload ``name`` ("sharegpt" or "alpaca"), sorted by
    arrival: Poisson arrivals at ``rate_per_s`` starting after one gap (``inf``: all at 0).
    UsageError for an unknown name, fewer than one request, or a rate that is not > 0."""
    workload = get_workload(name)
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise UsageError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if not rate_per_s > 0:  # also refuses NaN
        raise UsageError(f"rate_per_s must be > 0, got {rate_per_s!r}")
    rng = random.Random(seed)
    mu_in, mu_out = workload.input_tokens.mu, workload.output_tokens.mu
    fresh = FreshSegments()
    requests: list[TraceRequest] = []
    now_s = 0.0
    for _ in range(num_requests):
        if math.isfinite(rate_per_s):
            now_s += rng.expovariate(rate_per_s)
        prompt = fresh.take(workload.input_tokens.sample(rng, mu_in))
        num_out = workload.output_tokens.sample(rng, mu_out)
        requests.append(TraceRequest(now_s, prompt, num_out))
    return requests
