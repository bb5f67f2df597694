"""Continuous batching over the KV allocators (pure Python, no torch).

The engine (and the simulator) drive it like this::

    sched = Scheduler(allocator, max_num_seqs=256, max_num_batched_tokens=8192,
                      max_model_len=4096)
    seq = sched.add_request("r1", prompt_ids, max_new_tokens=64, stop_token_ids={eos})
    while sched.has_unfinished():
        batch = sched.schedule()          # ScheduledBatch: seqs, copies, preempted, refused
        ...                               # apply swap_out, swap_in, block_copies; run seqs
        done = sched.update(batch, sampled)  # sampled: one list of token ids per batch.seqs entry
"""

from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.preemption import (
    PREEMPTION_MODES,
    VICTIM_POLICIES,
    VictimPolicy,
    get_victim_policy,
    latest_arrival,
    least_computed,
)
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sched.sequence import FinishReason, Seq, SequenceStatus

__all__ = [
    "PREEMPTION_MODES",
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
