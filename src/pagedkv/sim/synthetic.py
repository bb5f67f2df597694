"""Synthetic workloads from a one-line spec, deterministic for a seed.

``SPEC`` is comma-separated ``key=value`` pairs (unknown keys are errors)::

    requests=200,prompt=2000-9000,output=200-800,rate=inf,system=0,turns=1,gap=10

* ``requests``: conversations (each of ``turns`` requests);
* ``prompt`` / ``output``: tokens, a fixed ``N`` or a uniform range ``A-B``; ``prompt`` is the new
  user text of each turn;
* ``rate``: conversations per second, Poisson arrivals (``inf``: all at time 0);
* ``system``: a system prompt of that many tokens shared by every request;
* ``turns``, ``gap``: turn ``k`` arrives ``k * gap`` seconds after the conversation starts and its
  prompt is the previous turn's prompt, its answer, then new user text (multi-turn growth; the
  simulated answer tokens are the ones the next prompt repeats, so they can be reused).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedkv.sim.traces import FreshSegments, TraceRequest

_KEYS = ("requests", "prompt", "output", "rate", "system", "turns", "gap")


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed spec (validated). Ranges are inclusive ``(low, high)`` token counts."""

    num_conversations: int = 100
    prompt_tokens: tuple[int, int] = (512, 2048)
    output_tokens: tuple[int, int] = (128, 512)
    rate_per_s: float = math.inf
    system_tokens: int = 0
    turns: int = 1
    turn_gap_s: float = 10.0

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.turns < 1:
            raise ValueError("requests and turns must be >= 1")
        for name, (lo, hi) in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= low <= high, got {lo}-{hi}")
        if self.rate_per_s <= 0 or self.system_tokens < 0 or self.turn_gap_s < 0:
            raise ValueError("rate must be > 0; system and gap must be >= 0")


def _range(key: str, text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise ValueError(f"synthetic spec: {key}={text!r} is not N or A-B") from None


def parse_spec(text: str) -> SyntheticSpec:
    """Parse ``SPEC`` (see the module docstring); ValueError names the offending item."""
    fields: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"synthetic spec: {item!r} is not one of {', '.join(_KEYS)}=VALUE")
        try:
            if key in ("prompt", "output"):
                fields[f"{key}_tokens"] = _range(key, value)
            elif key == "requests":
                fields["num_conversations"] = int(value)
            elif key == "rate":
                fields["rate_per_s"] = float(value)
            elif key == "system":
                fields["system_tokens"] = int(value)
            elif key == "turns":
                fields["turns"] = int(value)
            else:
                fields["turn_gap_s"] = float(value)
        except ValueError as exc:
            raise ValueError(f"synthetic spec: {item!r}: {exc}") from None
    return SyntheticSpec(**fields)  # type: ignore[arg-type]


def generate(spec: SyntheticSpec, seed: int = 0) -> list[TraceRequest]:
    """The requests of ``spec``, sorted by arrival. Same spec and seed, same requests."""
    rng = random.Random(seed)
    fresh = FreshSegments()
    system = fresh.take(spec.system_tokens) if spec.system_tokens else ()
    requests: list[TraceRequest] = []
    start_s = 0.0
    for _ in range(spec.num_conversations):
        if math.isfinite(spec.rate_per_s):
            start_s += rng.expovariate(spec.rate_per_s)
        history = system
        for turn in range(spec.turns):
            prompt = history + fresh.take(rng.randint(*spec.prompt_tokens))
            num_out = rng.randint(*spec.output_tokens)
            answer = fresh.take(num_out) if turn + 1 < spec.turns else ()
            requests.append(TraceRequest(start_s + turn * spec.turn_gap_s, prompt, num_out, answer))
            history = prompt + answer
    requests.sort(key=lambda r: r.arrival_time_s)
    return requests
