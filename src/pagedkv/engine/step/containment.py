"""Containment: a failure inside a step ends only the requests it can be traced to.

The forward pass and the sampler run the whole batch at once. When that raises, each entry is
run again on its own (same slots, same tokens, stateless seeded draws: a repeat writes the same
KV and samples the same token), so the entries that fail alone are the ones to blame and every
other entry keeps its result. A failure that every entry meets alone (out of memory, a broken
kernel) fails them all, and the engine still goes on to the next step. Except a device fault
(``device_fault``): a CUDA error such as an illegal address leaves the context unusable and
surfaces at whatever call comes next, so no entry can be blamed or retried; it is raised, and
the caller's own failure handling (the server marks a failing engine failed) takes over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pagedkv.errors import RankFailure
from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq

T = TypeVar("T")


Failures = list[tuple[ScheduledSeq, Exception]]


def run_contained(
    batch: ScheduledBatch, run: Callable[[ScheduledBatch], list[T | Exception]]
) -> tuple[list[T | None], Failures]:
    """``run(batch)`` returns one result per entry of ``batch.seqs``, or the exception an entry
    already failed with alone (``split_failures``). Returns the results (None where the entry
    failed) and the failed entries with their exceptions."""
    try:
        return split_failures(batch, run(batch))
    except Exception as exc:  # noqa: BLE001 - any failure but a device fault is traced below
        if device_fault(exc):
            raise
        if len(batch.seqs) <= 1:
            return [None] * len(batch.seqs), [(item, exc) for item in batch.seqs]
    results: list[T | Exception] = []
    for item in batch.seqs:
        # Each retry applies the step's block copies again: copying a block twice is a no-op
        # (a prefix copy's source is a full block nobody writes).
        alone = ScheduledBatch(
            batch.step, (item,), batch.block_copies, prefix_copies=batch.prefix_copies
        )
        try:
            results.append(run(alone)[0])
        except Exception as exc:  # noqa: BLE001
            if device_fault(exc):
                raise
            results.append(exc)
    return split_failures(batch, results)


def split_failures(
    batch: ScheduledBatch, results: list[T | Exception]
) -> tuple[list[T | None], Failures]:
    """``results`` (one per entry of ``batch.seqs``) with each exception replaced by None and
    listed with its entry among the failures."""
    pairs = list(zip(batch.seqs, results, strict=True))
    failures = [(item, r) for item, r in pairs if isinstance(r, Exception)]
    return [None if isinstance(r, Exception) else r for r in results], failures


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error that poisons the device context (torch raises them as
    ``AcceleratorError``, older releases as a ``RuntimeError`` saying "CUDA error"), or a
    tensor-parallel rank's failure (``RankFailure``: the ranks' collectives are out of step).
    Out of memory is not one: it is contained like any other failure."""
    if isinstance(exc, RankFailure):
        return True
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in str(exc)
