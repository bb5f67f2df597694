"""Preemption victim policies: which running sequence gives its blocks back.

A policy is a plain function ``(candidates) -> victim``. The scheduler passes the running
sequences it has not yet scheduled in the current step plus the one that needs room, in
running order (never empty). Preemption is by recompute: the victim's blocks are freed (full
ones stay in the prefix cache) and it goes back to the head of the waiting queue.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from pagedkv.sched.sequence import Seq

VictimPolicy = Callable[[SequenceABC[Seq]], Seq]


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
