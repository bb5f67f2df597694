"""What one scheduler step hands to the engine (or to the simulator's cost model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.sched.sequence import Seq


class ScheduledSeq(NamedTuple):
    """One sequence in a step: compute tokens ``[num_computed_tokens, + num_new_tokens)``.

    Their slots are ``allocator.slot_mapping(seq, num_computed_tokens, num_computed_tokens +
    num_new_tokens)``; attention reads every earlier token of the sequence as context.
    ``num_samples`` is how many tokens the engine samples from the logits of the last new token:
    0 while a prompt chunk does not reach the end of the known tokens (no logits needed), 1
    normally, ``n`` on the last prompt chunk of a request with ``n > 1`` samples (the scheduler
    forks the children from those samples in ``update``).
    """

    seq: Seq
    num_computed_tokens: int  # before this step, prefix-cache hits included
    num_new_tokens: int
    num_samples: int
    prefix_hit_tokens: int  # tokens reused from the prefix cache by an admission in this step

    @property
    def needs_logits(self) -> bool:
        return self.num_samples > 0


@dataclass(frozen=True)
class ScheduledBatch:
    """The plan of one step. The caller may keep it; the sequences inside keep changing.

    The engine must apply ``block_copies`` (``(src_block, dst_block)`` pairs, whole blocks)
    before the forward pass, run ``seqs``, then call ``Scheduler.update`` with one list of
    sampled token ids per entry of ``seqs`` (empty where ``num_samples == 0``).
    ``preempted`` lost their blocks this step and wait again (recompute); ``refused`` are
    finished with ``FinishReason.REFUSED`` and never ran.
    """

    step: int
    seqs: tuple[ScheduledSeq, ...]
    block_copies: tuple[tuple[int, int], ...] = ()
    preempted: tuple[Seq, ...] = ()
    refused: tuple[Seq, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(s.prefix_hit_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (there may still be refusals or copies to report)."""
        return not self.seqs


class Fork(NamedTuple):
    """A child forked in ``update`` for draw ``sample_offset`` (>= 1) of ``parent``'s first
    token: with the parent's own sample index ``i``, the child is sample ``i + offset``."""

    parent: Seq
    child: Seq
    sample_offset: int


@dataclass(frozen=True)
class StepUpdate:
    """What ``Scheduler.update`` did: the sequences it finished (blocks already freed) and the
    children it forked, in draw order. Lists the caller may keep."""

    finished: list[Seq]
    forked: list[Fork]
