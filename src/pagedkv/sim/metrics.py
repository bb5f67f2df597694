"""What a simulation measures: per-request timings, per-run time series, and ``RunResult``,
everything one run (or one replica of a cluster run) produced."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.kvcache.policies import Policy


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class RequestRecord:
    """What happened to one request (times in simulated seconds)."""

    __slots__ = (
        "arrival_s",
        "prompt_tokens",
        "admitted_s",
        "first_token_s",
        "finish_s",
        "num_output_tokens",
        "prefix_hit_tokens",
        "refused",
    )

    def __init__(self, arrival_s: float, prompt_tokens: int) -> None:
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.num_output_tokens = 0
        self.prefix_hit_tokens = 0  # at the first admission only (re-admissions are recompute)
        self.refused = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.finish_s is None or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass
class TimeSeries:
    """Samples taken at (roughly) fixed simulated-time intervals, one list per quantity; the
    ``*_frac`` ones are fractions of the pool's slots."""

    time_s: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    kv_utilization: list[float] = field(default_factory=list)
    fragmentation_frac: list[float] = field(default_factory=list)
    reserved_unused_frac: list[float] = field(default_factory=list)
    cached_frac: list[float] = field(default_factory=list)

    def mean(self, name: str) -> float:
        values = getattr(self, name)
        return sum(values) / len(values) if values else 0.0


@dataclass
class RunResult:
    """Everything one run (or one replica of a cluster run) produced. ``records`` follow the
    trace order (a replica's: the requests it served)."""

    policy: Policy
    block_size: int
    num_kv_slots: int
    records: list[RequestRecord]
    series: TimeSeries
    duration_s: float
    num_steps: int
    peak_running: int
    mean_running: float  # time-weighted over steps
    preemptions: int
    recomputed_tokens: int
    evictions: int
    wall_time_s: float  # real seconds the replay took (not part of the simulated result)
    # Swap preemption (all 0 under recompute): sequences and blocks moved, victims that found
    # the swap space full and were recomputed, and the simulated seconds spent on transfers.
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_blocks_out: int = 0
    swapped_blocks_in: int = 0
    swap_fallbacks: int = 0
    swap_time_s: float = 0.0
    # Partial-block prefix reuse (kvcache/partial.py): hits ending inside a block, their tokens
    # there, blocks claimed in place, and the copies of the others (bytes, simulated seconds).
    partial_hits: int = 0
    partial_hit_tokens: int = 0
    partial_claims: int = 0
    prefix_copy_bytes: int = 0
    prefix_copy_time_s: float = 0.0
