"""A tiny deterministic "engine" for scheduler tests: no model, tokens from a fixed rule."""

from __future__ import annotations

from pagedkv.sched import ScheduledBatch, Scheduler, Seq


def next_token(seq: Seq, sample_index: int = 0) -> int:
    """A token that depends only on the sequence's own tokens (so a recomputed sequence
    samples exactly what it would have sampled without preemption)."""
    tail = seq.token_ids[-3:]
    return (sum(tail) * 31 + len(seq.token_ids) + 7 * sample_index) % 997 + 1000


def sample(batch: ScheduledBatch) -> list[list[int]]:
    return [[next_token(s.seq, k) for k in range(s.num_samples)] for s in batch.seqs]


def step(sched: Scheduler) -> tuple[ScheduledBatch, list[Seq]]:
    """One schedule + update, checking the invariants (allocator, swap space, queues) after
    each half."""
    batch = sched.schedule()
    sched.check_invariants()
    finished = sched.update(batch, sample(batch)).finished
    sched.check_invariants()
    return batch, finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[Seq]:
    """Step until nothing is waiting or running; returns every finished sequence in order."""
    done: list[Seq] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return done
        batch, finished = step(sched)
        assert batch.seqs, "a step with work left scheduled nothing (deadlock)"
        done.extend(finished)
    raise AssertionError(f"not finished after {max_steps} steps")
