"""``Replica``: one simulated engine, stepped one step at a time (``RunResult``, in
``sim/metrics.py``: what it did).

The one step loop of the simulator. ``Simulation`` (one engine) and ``Cluster`` (N engines
behind a router) both drive replicas: ``admit`` queues a request at the replica's clock,
``step`` schedules one batch with the real ``Scheduler``, prices it with the cost model (plus
the swap transfers and the partial prefix hits' device copies it ordered), advances the clock by that, samples the token each sequence
gets, updates the scheduler and records first tokens and finishes.

A replica writes only into the ``RequestRecord`` objects it is given (``records[i]`` for the
requests it admits), so N replicas can share one records list in trace order.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from pagedkv.errors import UsageError
from pagedkv.kvcache.events import KVEventLog
from pagedkv.kvcache.policies import Policy, build_allocator
from pagedkv.sched import SchedulerConfig
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.links import DeviceCopy, Link
from pagedkv.sim.metrics import RequestRecord, RunResult, TimeSeries
from pagedkv.sim.pagedkv_triton.step_context import LongestShape
from pagedkv.traces import TraceRequest, segment_tokens

# Generated tokens the trace does not know get ids above every segment token: never shared.
_FRESH_TOKEN_BASE = 2**31

ProgressFn = Callable[[int, float], None]  # (requests done, simulated seconds)


class Replica:
    """One engine: its own allocator and scheduler, a clock (``now``, the next step boundary)
    and the accumulators of its ``RunResult``. ``events``: the allocator reports its prefix
    cache to ``self.events`` (a ``KVEventLog`` the caller drains after each step).

    Validation (UsageError) is the same as ``Simulation``'s: see there."""

    def __init__(
        self,
        policy: Policy,
        num_kv_slots: int,
        config: SchedulerConfig,
        cost: CostModel,
        records: list[RequestRecord],
        *,
        sample_interval_s: float = 1.0,
        link: Link | None = None,
        kv_record_bytes: int = 0,
        transfers_per_block: int = 1,
        events: bool = False,
        device_copy: DeviceCopy | None = None,
    ) -> None:
        _check(config, link, kv_record_bytes, transfers_per_block, sample_interval_s)
        assert config.max_model_len is not None  # checked
        self.policy = policy
        self.allocator = build_allocator(policy, num_kv_slots, config.max_model_len)
        self.events: KVEventLog | None = None
        if events:  # before the first admission (the radix allocator insists)
            self.events = KVEventLog()
            self.allocator.enable_events(self.events)
        try:  # a swap space too small for one block of this policy is the user's input
            self.scheduler = config.build(self.allocator)
        except ValueError as exc:
            raise UsageError(f"{policy.name}: {exc}") from None
        self.num_kv_slots = num_kv_slots
        self.cost = cost
        self.records = records
        self.sample_interval_s = sample_interval_s
        self.link = link
        self.device_copy = device_copy  # None: the prefix copies cost nothing
        self.kv_record_bytes = kv_record_bytes
        self.block_bytes = kv_record_bytes * self.allocator.block_size
        self.transfers_per_block = transfers_per_block
        self.series = TimeSeries()
        self.now = 0.0  # the next step boundary (simulated seconds)
        self.next_sample_s = 0.0
        self.sampled = False  # whether the last step took a sample
        self._index_of: dict[int, int] = {}  # seq id -> request index
        self._planned: dict[int, array] = {}  # seq id -> the answer tokens the trace knows
        self._fresh_token = _FRESH_TOKEN_BASE
        self.num_steps = self.peak_running = 0
        self.running_time = 0.0  # integral of running sequences over time
        self.swap_time = 0.0
        self.copy_time = 0.0
        self.copy_bytes = 0

    def admit(self, i: int, req: TraceRequest, prompt: array | None = None) -> bool:
        """Queue request ``i`` (``records[i]``) now; ``prompt``: its token ids when the caller
        has them already. False (the record says refused) when it can never run."""
        sched = self.scheduler
        num_out = max(1, req.output_len_tokens)
        if sched.refusal(req.prompt_len_tokens, num_out, 1) is not None:
            self.records[i].refused = True
            return False
        seq = sched.add_request(
            str(i),
            segment_tokens(req.prompt) if prompt is None else prompt,
            num_out,
            arrival_time_s=req.arrival_time_s,
        )
        if seq.is_finished:
            self.records[i].refused = True
            return False
        self._index_of[seq.seq_id] = i
        if req.output:
            self._planned[seq.seq_id] = segment_tokens(req.output)
        return True

    def step(self) -> int:
        """One step at ``now`` (the scheduler must have unfinished work); ``now`` moves to its
        end. Returns how many requests finished in it. Samples the time series when due
        (``sampled`` says whether this step did)."""
        sched = self.scheduler
        batch = sched.schedule()
        if not batch.seqs and not batch.preempted:
            raise RuntimeError(f"scheduler stalled at t={self.now:.3f}s with work waiting")
        transfer_s = self._moves_time_s(batch)
        sampled, first_tokens = self._draw(batch)
        shape = LongestShape.of(
            ((start, n) for _, start, n, _, _ in batch.seqs), self.allocator.block_size
        )
        # A step that only swapped its last sequence out costs its transfers alone.
        dt = transfer_s + (self.cost.step_time_s(shape) if batch.seqs else 0.0)
        now = self.now = self.now + dt
        self.num_steps += 1
        num_running = len(sched.running)
        if num_running > self.peak_running:
            self.peak_running = num_running
        self.running_time += num_running * dt
        for rec in first_tokens:
            rec.first_token_s = now
        num_finished = 0
        for seq in sched.update(batch, sampled).finished:
            rec = self.records[self._index_of.pop(seq.seq_id)]
            self._planned.pop(seq.seq_id, None)
            rec.finish_s = now
            rec.num_output_tokens = seq.num_output_tokens
            num_finished += 1
        self.sampled = now >= self.next_sample_s
        if self.sampled:
            self._sample(now)
            self.next_sample_s = now + self.sample_interval_s
        return num_finished

    def _moves_time_s(self, batch: ScheduledBatch) -> float:
        """Seconds of ``batch``'s swap transfers and partial hits' prefix copies, before the
        forward pass (counted in ``swap_time``, ``copy_time`` and ``copy_bytes``)."""
        transfer_s = 0.0
        num_moved = len(batch.swap_out) + len(batch.swap_in)
        if num_moved and self.link is not None:
            transfer_s = self.link.transfer_time_s(
                num_moved, self.block_bytes, self.transfers_per_block
            )
            self.swap_time += transfer_s
        if batch.prefix_copies:  # the matched slots of partial hits, before the forward pass
            copied = sum(c.num_tokens for c in batch.prefix_copies) * self.kv_record_bytes
            self.copy_bytes += copied
            if self.device_copy is not None:
                copy_s = self.device_copy.time_s(copied)
                self.copy_time += copy_s
                transfer_s += copy_s
        return transfer_s

    def _draw(self, batch: ScheduledBatch) -> tuple[list[list[int]], list[RequestRecord]]:
        """The token each entry of ``batch`` samples (the trace's answer while it lasts, else a
        fresh id), and the records whose first token it is; admissions are recorded at ``now``."""
        records, index_of = self.records, self._index_of
        sampled: list[list[int]] = []
        first_tokens: list[RequestRecord] = []
        for seq, start, _, num_samples, hit in batch.seqs:
            if start == hit:  # an admission (decode steps always have start > hit == 0)
                rec = records[index_of[seq.seq_id]]
                if rec.admitted_s is None:
                    rec.admitted_s = self.now
                    rec.prefix_hit_tokens = hit
            if not num_samples:
                sampled.append([])
                continue
            answer = self._planned.get(seq.seq_id)
            k = seq.num_output_tokens
            if answer is not None and k < len(answer):
                sampled.append([answer[k]])
            else:
                sampled.append([self._fresh_token])
                self._fresh_token += 1
            if k == 0:
                first_tokens.append(records[index_of[seq.seq_id]])
        return sampled, first_tokens

    def _sample(self, now: float) -> None:
        s = self.allocator.stats()
        total = s.num_total_slots or 1
        series = self.series
        series.time_s.append(now)
        series.running.append(self.scheduler.num_running)
        series.waiting.append(self.scheduler.num_waiting)
        series.kv_utilization.append(s.used_slots / total)
        series.fragmentation_frac.append(s.internal_fragmentation_slots / total)
        series.reserved_unused_frac.append(s.reserved_unused_slots / total)
        series.cached_frac.append(s.num_cached_blocks * s.block_size / total)

    def result(
        self, records: list[RequestRecord], duration_s: float, wall_time_s: float
    ) -> RunResult:
        """This replica's ``RunResult`` over ``duration_s`` (its mean running is the running
        integral over that duration)."""
        sched = self.scheduler
        kv = self.allocator.stats()
        return RunResult(
            policy=self.policy,
            block_size=self.allocator.block_size,
            num_kv_slots=self.num_kv_slots,
            records=records,
            series=self.series,
            duration_s=duration_s,
            num_steps=self.num_steps,
            peak_running=self.peak_running,
            mean_running=self.running_time / duration_s if duration_s > 0 else 0.0,
            preemptions=sched.num_preemptions,
            recomputed_tokens=sched.num_recomputed_tokens,
            evictions=kv.num_evictions,
            wall_time_s=wall_time_s,
            swap_outs=sched.num_swap_outs,
            swap_ins=sched.num_swap_ins,
            swapped_blocks_out=sched.num_swapped_blocks_out,
            swapped_blocks_in=sched.num_swapped_blocks_in,
            swap_fallbacks=sched.num_swap_fallbacks,
            swap_time_s=self.swap_time,
            partial_hits=kv.num_partial_hits,
            partial_hit_tokens=kv.partial_hit_tokens,
            partial_claims=kv.num_partial_claims,
            prefix_copy_bytes=self.copy_bytes,
            prefix_copy_time_s=self.copy_time,
        )


def admit_due(replica: Replica, requests: Sequence[TraceRequest], start: int) -> tuple[int, int]:
    """Admit ``requests[start:]`` that arrived by ``replica.now``; returns (the next request
    index, how many were refused)."""
    n, refused = len(requests), 0
    while start < n and requests[start].arrival_time_s <= replica.now:
        refused += not replica.admit(start, requests[start])
        start += 1
    return start, refused


def _check(
    config: SchedulerConfig,
    link: Link | None,
    kv_record_bytes: int,
    transfers_per_block: int,
    sample_interval_s: float,
) -> None:
    """UsageError for what a replica cannot run or price with these settings."""
    if config.max_model_len is None:
        raise UsageError("the simulator needs max_model_len")
    if not isinstance(kv_record_bytes, int) or kv_record_bytes < 0:
        raise UsageError(f"kv_record_bytes must be an integer >= 0, got {kv_record_bytes!r}")
    if not isinstance(transfers_per_block, int) or transfers_per_block < 1:
        raise UsageError(
            f"transfers_per_block must be an integer >= 1, got {transfers_per_block!r}"
        )
    if config.preemption_mode == "swap" and (link is None or kv_record_bytes == 0):
        raise UsageError(
            "swap preemption needs a host link and kv_record_bytes > 0 to price its "
            "transfers (see pagedkv.sim.links)"
        )
    if sample_interval_s <= 0:
        raise UsageError(f"sample interval must be > 0 s, got {sample_interval_s}")
