"""Preemption victim policies: which running sequence gives its blocks back.

A policy is a plain function ``(candidates) -> victim``. The scheduler passes the running
sequences it has not yet scheduled in the current step plus the one that needs room, in
running order (never empty). What happens to the victim is the preemption mode: ``recompute``
frees its blocks (full ones stay in the prefix cache) and puts it back at the head of the
waiting queue; ``swap`` copies its blocks to the host swap space first and keeps its progress
(see ``sched/scheduler.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from pagedkv.sched.sequence import Seq

VictimPolicy = Callable[[SequenceABC[Seq]], Seq]

PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")


def latest_arrival(candidates: SequenceABC[Seq]) -> Seq:
    """The most recently arrived sequence (ties: the highest seq id). First come, first served:
    the oldest requests keep their progress."""
    return max(candidates, key=lambda s: (s.arrival_time_s, s.seq_id))


def least_computed(candidates: SequenceABC[Seq]) -> Seq:
    """The sequence with the fewest computed tokens: the cheapest to recompute (ties: the
    latest arrival)."""
    return min(candidates, key=lambda s: (s.num_computed_tokens, -s.arrival_time_s, -s.seq_id))


VICTIM_POLICIES: dict[str, VictimPolicy] = {
    "latest_arrival": latest_arrival,
    "least_computed": least_computed,
}


def get_victim_policy(name: str) -> VictimPolicy:
    """The policy called ``name``; ValueError names the choices."""
    try:
        return VICTIM_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown preemption policy {name!r}; choose one of {', '.join(VICTIM_POLICIES)}"
        ) from None
