"""Synthetic workloads from a one-line spec, deterministic for a seed.

``SPEC`` is comma-separated ``key=value`` pairs (unknown keys are errors)::

    requests=200,prompt=2000-9000,output=200-800,rate=inf,system=0,turns=1,gap=10

* ``requests``: conversations (each of ``turns`` requests);
* ``prompt`` / ``output``: tokens, a fixed ``N``, a uniform range ``A-B``, or ``exp:MEAN[:MAX]``
  (exponential with that mean, at least 1, at most MAX); ``prompt`` is the new user text of
  each turn;
* ``rate``: conversations per second, Poisson arrivals (``inf``: all at time 0);
* ``system``: a system prompt of that many tokens shared by every request;
* ``workload``: ``sharegpt`` or ``alpaca``, the PagedAttention paper's length distributions
  (``traces/paper_workloads.py``) with ``requests`` and ``rate``; it takes the place of
  ``prompt``, ``output``, ``system``, ``turns`` and ``gap``
  (``workload=sharegpt,requests=500,rate=2``);
* ``turns``, ``gap``: turn ``k`` arrives ``k * gap`` seconds after the conversation starts and its
  prompt is the previous turn's prompt, its answer, then new user text (multi-turn growth; the
  simulated answer tokens are the ones the next prompt repeats, so they can be reused).

Numbers must be finite (``rate=inf`` is the one spelled exception); at most
``MAX_SYNTHETIC_REQUESTS`` requests in all. Lengths are not capped here: a prompt longer than
the context is the scheduler's to refuse, and costs nothing until then (one fresh segment).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.traces.paper_workloads import get_workload, paper_workload
from pagedkv.traces.segments import FreshSegments, TraceRequest

MAX_SYNTHETIC_REQUESTS = 10_000_000
_KEYS = ("requests", "prompt", "output", "rate", "system", "turns", "gap", "workload")
_SHAPE_KEYS = ("prompt", "output", "system", "turns", "gap")  # a paper workload fixes these


@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution: uniform over ``[low, high]`` (fixed when equal), or with
    ``kind="exp"`` exponential with mean ``low``, rounded, clipped to ``[1, high]``."""

    low: int
    high: int
    kind: str = "uniform"

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "exp") or not 1 <= self.low <= self.high:
            raise UsageError(f"a length needs 1 <= low <= high, got {self.low}-{self.high}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "exp":
            return min(self.high, max(1, round(rng.expovariate(1.0 / self.low))))
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed spec (validated)."""

    num_conversations: int = 100
    prompt_tokens: LengthDist = LengthDist(512, 2048)
    output_tokens: LengthDist = LengthDist(128, 512)
    rate_per_s: float = math.inf
    system_tokens: int = 0
    turns: int = 1
    turn_gap_s: float = 10.0
    workload: str | None = None  # a paper workload's name: lengths from it, not the fields

    def __post_init__(self) -> None:
        if self.workload is not None:
            object.__setattr__(self, "workload", get_workload(self.workload).name)
        if self.num_conversations < 1 or self.turns < 1:
            raise UsageError("synthetic spec: requests and turns must be >= 1")
        if self.num_conversations * self.turns > MAX_SYNTHETIC_REQUESTS:
            raise UsageError(
                f"synthetic spec: requests x turns must be at most {MAX_SYNTHETIC_REQUESTS:,}"
            )
        # `not x > 0` (rather than `x <= 0`) also refuses NaN, which compares false with all
        if not self.rate_per_s > 0 or self.system_tokens < 0 or not self.turn_gap_s >= 0:
            raise UsageError("synthetic spec: rate must be > 0; system and gap must be >= 0")
        if not math.isfinite(self.turn_gap_s):
            raise UsageError(f"synthetic spec: gap must be finite, got {self.turn_gap_s}")


def _length(key: str, text: str) -> LengthDist:
    try:
        if text.startswith("exp:"):
            mean, _, top = text[4:].partition(":")
            return LengthDist(int(mean), int(top) if top else 2**31 - 1, "exp")
        lo, sep, hi = text.partition("-")
        return LengthDist(int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise UsageError(
            f"synthetic spec: {key}={text!r} is not N, A-B or exp:MEAN[:MAX] with 1 <= A <= B"
        ) from None


def _finite(text: str, allow_inf: bool = False) -> float:
    value = float(text)
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        raise ValueError(f"must be a finite number{' or inf' if allow_inf else ''}")
    return value


def parse_spec(text: str) -> SyntheticSpec:
    """Parse ``SPEC`` (see the module docstring); ValueError names the offending item."""
    fields: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS:
            raise UsageError(f"synthetic spec: {item!r} is not one of {', '.join(_KEYS)}=VALUE")
        try:
            if key in ("prompt", "output"):
                fields[f"{key}_tokens"] = _length(key, value)
            elif key == "requests":
                fields["num_conversations"] = int(value)
            elif key == "rate":
                fields["rate_per_s"] = _finite(value, allow_inf=True)
            elif key == "system":
                fields["system_tokens"] = int(value)
            elif key == "turns":
                fields["turns"] = int(value)
            elif key == "workload":
                fields["workload"] = value
            else:
                fields["turn_gap_s"] = _finite(value)
        except ValueError as exc:
            raise UsageError(f"synthetic spec: {item!r}: {exc}") from None
    given = {p.strip().partition("=")[0] for p in text.split(",") if p.strip()}
    if "workload" in given:
        clash = [k for k in _SHAPE_KEYS if k in given]
        if clash:
            raise UsageError(
                f"synthetic spec: workload= sets the lengths; drop {', '.join(clash)}="
            )
    return SyntheticSpec(**fields)  # type: ignore[arg-type]


def generate(
    spec: SyntheticSpec, seed: int = 0, max_requests: int | None = None
) -> list[TraceRequest]:
    """The requests of ``spec``, sorted by arrival (the first ``max_requests`` of them). Same
    spec and seed, same requests: with ``max_requests`` exactly the first ones of the whole
    workload, built without building the rest."""
    if spec.workload is not None:  # arrivals are in order: the first N are the earliest N
        count = min(spec.num_conversations, max_requests or spec.num_conversations)
        return paper_workload(spec.workload, count, spec.rate_per_s, seed)
    rng = random.Random(seed)
    fresh = FreshSegments()
    system = fresh.take(spec.system_tokens) if spec.system_tokens else ()
    requests: list[TraceRequest] = []
    earliest: list[float] = []  # max-heap (negated) of the max_requests earliest arrivals
    start_s = 0.0
    for _ in range(spec.num_conversations):
        if math.isfinite(spec.rate_per_s):
            start_s += rng.expovariate(spec.rate_per_s)
        # Conversations start in order and turns only add time: once the max_requests
        # earliest arrivals all come no later than this start, no later request can be among
        # them (a tie sorts after them, as in the whole workload's stable sort).
        if max_requests and len(earliest) == max_requests and start_s >= -earliest[0]:
            break
        history = system
        for turn in range(spec.turns):
            prompt = history + fresh.take(spec.prompt_tokens.sample(rng))
            num_out = spec.output_tokens.sample(rng)
            answer = fresh.take(num_out) if turn + 1 < spec.turns else ()
            arrival_s = start_s + turn * spec.turn_gap_s
            requests.append(TraceRequest(arrival_s, prompt, num_out, answer))
            history = prompt + answer
            if max_requests:
                if len(earliest) < max_requests:
                    heapq.heappush(earliest, -arrival_s)
                elif arrival_s < -earliest[0]:
                    heapq.heapreplace(earliest, -arrival_s)
    requests.sort(key=lambda r: r.arrival_time_s)
    return requests[:max_requests] if max_requests else requests
