"""Replay a trace through the engine's own ``Scheduler`` and allocator; only the model is
replaced by a cost model that says how long each step takes.

The clock is simulated: requests join the scheduler at the first step boundary at or after
their arrival, each step lasts ``cost.step_time_s``, and a token sampled in a step exists at the
end of that step. Nothing is random here, so a run is a pure function of its inputs.

With swap preemption (``SchedulerConfig(preemption_mode="swap")``) a step also lasts the
transfers it ordered, before its compute: one transfer per block swapped out or in, as the
first article counts them, priced by ``link`` for blocks of ``kv_record_bytes * block_size``
bytes (``sim/links.py``); ``transfers_per_block = 2 * num_layers`` prices an engine that keeps
one K and one V tensor per layer and copies each block of each (vLLM v0). The transfers are
serial with the step, as in vLLM v0, where the model waits for the step's swaps.

Every request generates at least one token (a prefill samples one, even where the trace says
0). A request the scheduler's refusal rule says can never run (longer than ``max_model_len``,
bigger than the pool) is recorded as refused *before* its tokens are materialized: a 2e9-token
prompt in a trace costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pagedkv.kvcache.policies import Policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.links import DeviceCopy, Link
from pagedkv.sim.metrics import RequestRecord, RunResult
from pagedkv.sim.replica import ProgressFn, Replica, admit_due
from pagedkv.traces import TraceRequest

__all__ = ["ProgressFn", "RunResult", "Simulation"]


class Simulation:
    """One replay: ``Simulation(requests, policy, num_kv_slots, config, cost).run()``.

    ``config.max_model_len`` must be set (the reserved allocator reserves exactly that).
    With ``config.preemption_mode == "swap"``, ``link`` and ``kv_record_bytes`` (one token's K
    and V over all layers) must be given: they price the swap transfers. The step itself is
    ``Replica.step`` (``sim/replica.py``), which ``Cluster`` drives for N engines.
    """

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        policy: Policy,
        num_kv_slots: int,
        config: SchedulerConfig,
        cost: CostModel,
        *,
        sample_interval_s: float = 1.0,
        progress: ProgressFn | None = None,
        check_invariants: bool = False,
        link: Link | None = None,
        kv_record_bytes: int = 0,
        transfers_per_block: int = 1,
        device_copy: DeviceCopy | None = None,
    ) -> None:
        """``check_invariants`` (for tests) checks the allocator and the swap space after every
        step. ``device_copy`` prices the partial prefix hits' copies (None: free)."""
        self.requests = requests
        self.policy = policy
        self.records = [RequestRecord(r.arrival_time_s, r.prompt_len_tokens) for r in requests]
        self.replica = Replica(
            policy,
            num_kv_slots,
            config,
            cost,
            self.records,
            sample_interval_s=sample_interval_s,
            link=link,
            kv_record_bytes=kv_record_bytes,
            transfers_per_block=transfers_per_block,
            device_copy=device_copy,
        )
        self.allocator = self.replica.allocator
        self.scheduler = self.replica.scheduler
        self.progress = progress
        self.check_invariants = check_invariants

    def run(self) -> RunResult:
        """Replay every request once (a second call is not supported: build a new one)."""
        wall_start = time.perf_counter()
        rep, sched, reqs = self.replica, self.scheduler, self.requests
        num_reqs, next_req, num_done = len(reqs), 0, 0
        while True:
            next_req, refused = admit_due(rep, reqs, next_req)
            num_done += refused
            if not sched.has_unfinished():
                if next_req >= num_reqs:
                    break
                rep.now = max(rep.now, reqs[next_req].arrival_time_s)
                continue
            num_done += rep.step()
            if self.check_invariants:
                sched.check_invariants()
            if rep.sampled and self.progress is not None:
                self.progress(num_done, rep.now)

        if self.progress is not None:
            self.progress(num_done, rep.now)
        start_s = reqs[0].arrival_time_s if reqs else 0.0
        return rep.result(self.records, rep.now - start_s, time.perf_counter() - wall_start)
