"""Containment: a failure inside a step ends only the requests it can be traced to.

The forward pass and the sampler run the whole batch at once. When that raises, each entry is
run again on its own (same slots, same tokens, stateless seeded draws: a repeat writes the same
KV and samples the same token), so the entries that fail alone are the ones to blame and every
other entry keeps its result. A failure that every entry meets alone (out of memory, a broken
kernel) fails them all, and the engine still goes on to the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq

T = TypeVar("T")


def run_contained(
    batch: ScheduledBatch, run: Callable[[ScheduledBatch], list[T]]
) -> tuple[list[T | None], list[tuple[ScheduledSeq, Exception]]]:
    """``run(batch)`` returns one result per entry of ``batch.seqs``. Returns the results
    (None where the entry failed) and the failed entries with their exceptions."""
    try:
        return list(run(batch)), []
    except Exception as exc:  # noqa: BLE001 - any failure is traced below, never re-raised
        if len(batch.seqs) <= 1:
            return [None] * len(batch.seqs), [(item, exc) for item in batch.seqs]
    results: list[T | None] = []
    failures: list[tuple[ScheduledSeq, Exception]] = []
    for item in batch.seqs:
        # Each retry applies the step's block copies again: copying a block twice is a no-op.
        alone = ScheduledBatch(batch.step, (item,), batch.block_copies)
        try:
            results.append(run(alone)[0])
        except Exception as exc:  # noqa: BLE001
            results.append(None)
            failures.append((item, exc))
    return results, failures
