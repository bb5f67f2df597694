"""Continuous batching over the KV allocators (pure Python, no torch).

The engine (and the simulator) drive it like this::

    sched = Scheduler(allocator, max_num_seqs=256, max_num_batched_tokens=8192,
                      max_model_len=4096)
    seq = sched.add_request("r1", prompt_ids, max_new_tokens=64, stop_token_ids={eos})
    while sched.has_unfinished():
        batch = sched.schedule()          # ScheduledBatch: seqs, block_copies, preempted, refused
        ...                               # apply batch.block_copies, run batch.seqs
        done = sched.update(batch, sampled)  # sampled: one list of token ids per batch.seqs entry
"""

from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.preemption import (
    VICTIM_POLICIES,
    VictimPolicy,
    get_victim_policy,
    latest_arrival,
    least_computed,
)
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sched.sequence import FinishReason, Seq, SequenceStatus

__all__ = [
    "VICTIM_POLICIES",
    "FinishReason",
    "ScheduledBatch",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "Seq",
    "SequenceStatus",
    "VictimPolicy",
    "get_victim_policy",
    "latest_arrival",
    "least_computed",
]
