"""The paper's workloads: the means the vLLM paper states, Poisson arrivals, seeded, checked."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pagedkv.errors import UsageError
from pagedkv.traces import generate, parse_spec, segment_tokens
from pagedkv.traces.paper_workloads import clipped_lognormal_mean, paper_workload

# vLLM paper §6.1 / Fig. 11: mean input and output lengths (tokens).
PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


@pytest.mark.parametrize("name", sorted(PAPER_MEANS))
def test_mean_lengths_are_the_papers(name: str) -> None:
    reqs = paper_workload(name, 40_000, rate_per_s=1.0, seed=3)
    mean_in = statistics.fmean(r.prompt_len_tokens for r in reqs)
    mean_out = statistics.fmean(r.output_len_tokens for r in reqs)
    want_in, want_out = PAPER_MEANS[name]
    assert mean_in == pytest.approx(want_in, rel=0.02)
    assert mean_out == pytest.approx(want_out, rel=0.02)
    # OPT's 2,048-token context holds every request; every length is at least one token
    assert all(1 <= r.prompt_len_tokens <= 1024 and 1 <= r.output_len_tokens <= 1024 for r in reqs)


def test_poisson_arrivals_at_the_rate() -> None:
    reqs = paper_workload("alpaca", 20_000, rate_per_s=8.0, seed=1)
    gaps = [b.arrival_time_s - a.arrival_time_s for a, b in itertools.pairwise(reqs)]
    assert min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8.0, rel=0.05)


def test_infinite_rate_puts_every_request_at_zero() -> None:
    assert {r.arrival_time_s for r in paper_workload("sharegpt", 50, math.inf)} == {0.0}


def test_seeded_and_no_shared_prefixes() -> None:
    a = paper_workload("sharegpt", 200, 2.0, seed=7)
    assert a == paper_workload("sharegpt", 200, 2.0, seed=7)
    assert a != paper_workload("sharegpt", 200, 2.0, seed=8)
    firsts = [segment_tokens(r.prompt)[0] for r in a]
    assert len(set(firsts)) == len(firsts)  # basic sampling: no request shares a prefix


def test_clipped_lognormal_mean_against_references() -> None:
    # unclipped (bounds far away): the log-normal mean exp(mu + sigma^2 / 2)
    assert clipped_lognormal_mean(1.0, 0.5, 1e-9, 1e9) == pytest.approx(math.exp(1.125))
    # a Monte Carlo reference for a clipped case
    rng = random.Random(0)
    xs = [min(50.0, max(1.0, rng.lognormvariate(3.0, 1.0))) for _ in range(200_000)]
    assert clipped_lognormal_mean(3.0, 1.0, 1, 50) == pytest.approx(statistics.fmean(xs), rel=0.01)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("lmsys", 10, 1.0), "unknown paper workload 'lmsys'"),
        (("alpaca", 0, 1.0), "num_requests"),
        (("alpaca", 10, 0.0), "rate_per_s"),
        (("alpaca", 10, math.nan), "rate_per_s"),
    ],
)
def test_bad_arguments_are_usage_errors(args: tuple, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        paper_workload(*args)


def test_the_synthetic_spec_names_a_paper_workload() -> None:
    spec = parse_spec("workload=Alpaca,requests=300,rate=5")
    assert spec.workload == "alpaca"
    assert generate(spec, seed=4) == paper_workload("alpaca", 300, 5.0, seed=4)
    # --max-requests: the first requests of the same workload
    assert generate(spec, seed=4, max_requests=7) == paper_workload("alpaca", 300, 5.0, 4)[:7]
    for clash in ("prompt=5", "output=5", "system=3", "turns=2", "gap=1"):
        with pytest.raises(UsageError, match=f"drop {clash.split('=')[0]}="):
            parse_spec(f"workload=sharegpt,{clash}")
    with pytest.raises(UsageError, match="unknown paper workload 'lmsys'"):
        parse_spec("workload=lmsys")
