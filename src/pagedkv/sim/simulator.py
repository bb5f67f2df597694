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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy, build_allocator
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import CostModel, StepShape
from pagedkv.sim.links import Link
from pagedkv.sim.metrics import RequestRecord, TimeSeries
from pagedkv.traces import TraceRequest, segment_tokens

# Generated tokens the trace does not know get ids above every segment token: never shared.
_FRESH_TOKEN_BASE = 2**31

ProgressFn = Callable[[int, float], None]  # (requests done, simulated seconds)


@dataclass
class RunResult:
    """Everything one run produced. ``records`` follow the trace order."""

    policy: Policy
    block_size: int
    num_kv_slots: int
    records: list[RequestRecord]
    series: TimeSeries
    duration_s: float
    num_steps: int
    peak_running: int
    mean_running: float  # time-weighted over steps
    preemptions: int
    recomputed_tokens: int
    evictions: int
    wall_time_s: float  # real seconds the replay took (not part of the simulated result)
    # Swap preemption (all 0 under recompute): sequences and blocks moved, victims that found
    # the swap space full and were recomputed, and the simulated seconds spent on transfers.
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_blocks_out: int = 0
    swapped_blocks_in: int = 0
    swap_fallbacks: int = 0
    swap_time_s: float = 0.0


class Simulation:
    """One replay: ``Simulation(requests, policy, num_kv_slots, config, cost).run()``.

    ``config.max_model_len`` must be set (the reserved allocator reserves exactly that).
    With ``config.preemption_mode == "swap"``, ``link`` and ``kv_record_bytes`` (one token's K
    and V over all layers) must be given: they price the swap transfers.
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
    ) -> None:
        """``check_invariants`` (for tests) checks the allocator and the swap space after every
        step."""
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
        self.requests = requests
        self.policy = policy
        self.allocator = build_allocator(policy, num_kv_slots, config.max_model_len)
        try:  # a swap space too small for one block of this policy is the user's input
            self.scheduler = config.build(self.allocator)
        except ValueError as exc:
            raise UsageError(f"{policy.name}: {exc}") from None
        self.num_kv_slots = num_kv_slots
        self.cost = cost
        self.sample_interval_s = sample_interval_s
        self.progress = progress
        self.check_invariants = check_invariants
        self.link = link
        self.block_bytes = kv_record_bytes * self.allocator.block_size
        self.transfers_per_block = transfers_per_block

    def run(self) -> RunResult:
        wall_start = time.perf_counter()
        sched, reqs = self.scheduler, self.requests
        records = [RequestRecord(r.arrival_time_s, r.prompt_len_tokens) for r in reqs]
        index_of: dict[int, int] = {}  # seq id -> request index
        planned: dict[int, array] = {}  # seq id -> the answer tokens the trace knows
        series = TimeSeries()
        num_reqs, next_req = len(reqs), 0
        now = next_sample_s = 0.0
        fresh_token = _FRESH_TOKEN_BASE
        num_steps = peak_running = num_done = 0
        running_time = 0.0  # integral of running sequences over time
        swap_time = 0.0

        while True:
            while next_req < num_reqs and reqs[next_req].arrival_time_s <= now:
                req = reqs[next_req]
                num_out = max(1, req.output_len_tokens)
                if sched.refusal(req.prompt_len_tokens, num_out, 1) is not None:
                    records[next_req].refused = True
                    num_done += 1
                    next_req += 1
                    continue
                seq = sched.add_request(
                    str(next_req),
                    segment_tokens(req.prompt),
                    num_out,
                    arrival_time_s=req.arrival_time_s,
                )
                if seq.is_finished:
                    records[next_req].refused = True
                    num_done += 1
                else:
                    index_of[seq.seq_id] = next_req
                    if req.output:
                        planned[seq.seq_id] = segment_tokens(req.output)
                next_req += 1
            if not sched.has_unfinished():
                if next_req >= num_reqs:
                    break
                now = max(now, reqs[next_req].arrival_time_s)
                continue

            batch = sched.schedule()
            if not batch.seqs and not batch.preempted:
                raise RuntimeError(f"scheduler stalled at t={now:.3f}s with work waiting")
            transfer_s = 0.0
            num_moved = len(batch.swap_out) + len(batch.swap_in)
            if num_moved and self.link is not None:
                transfer_s = self.link.transfer_time_s(
                    num_moved, self.block_bytes, self.transfers_per_block
                )
                swap_time += transfer_s
            num_tokens = kv_read = pairs = num_decode = blocks_read = 0
            block_size = self.allocator.block_size
            sampled: list[list[int]] = []
            first_tokens: list[RequestRecord] = []
            for seq, start, n, num_samples, hit in batch.seqs:
                num_tokens += n
                kv_read += start + n
                pairs += n * start + n * (n + 1) // 2
                blocks_read += -(-(start + n) // block_size)
                num_decode += n == 1 and start > 0
                if start == hit:  # an admission (decode steps always have start > hit == 0)
                    rec = records[index_of[seq.seq_id]]
                    if rec.admitted_s is None:
                        rec.admitted_s = now
                        rec.prefix_hit_tokens = hit
                if not num_samples:
                    sampled.append([])
                    continue
                answer = planned.get(seq.seq_id)
                k = seq.num_output_tokens
                if answer is not None and k < len(answer):
                    sampled.append([answer[k]])
                else:
                    sampled.append([fresh_token])
                    fresh_token += 1
                if k == 0:
                    first_tokens.append(records[index_of[seq.seq_id]])

            shape = StepShape(
                num_tokens, kv_read, pairs, len(batch.seqs), num_decode, blocks_read, block_size
            )
            # A step that only swapped its last sequence out costs its transfers alone.
            dt = transfer_s + (self.cost.step_time_s(shape) if batch.seqs else 0.0)
            now += dt
            num_steps += 1
            num_running = len(sched.running)
            peak_running = max(peak_running, num_running)
            running_time += num_running * dt
            for rec in first_tokens:
                rec.first_token_s = now
            for seq in sched.update(batch, sampled).finished:
                rec = records[index_of.pop(seq.seq_id)]
                planned.pop(seq.seq_id, None)
                rec.finish_s = now
                rec.num_output_tokens = seq.num_output_tokens
                num_done += 1
            if self.check_invariants:
                sched.check_invariants()
            if now >= next_sample_s:
                self._sample(series, now)
                next_sample_s = now + self.sample_interval_s
                if self.progress is not None:
                    self.progress(num_done, now)

        if self.progress is not None:
            self.progress(num_done, now)
        start_s = reqs[0].arrival_time_s if reqs else 0.0
        duration = now - start_s
        return RunResult(
            policy=self.policy,
            block_size=self.allocator.block_size,
            num_kv_slots=self.num_kv_slots,
            records=records,
            series=series,
            duration_s=duration,
            num_steps=num_steps,
            peak_running=peak_running,
            mean_running=running_time / duration if duration > 0 else 0.0,
            preemptions=sched.num_preemptions,
            recomputed_tokens=sched.num_recomputed_tokens,
            evictions=self.allocator.stats().num_evictions,
            wall_time_s=time.perf_counter() - wall_start,
            swap_outs=sched.num_swap_outs,
            swap_ins=sched.num_swap_ins,
            swapped_blocks_out=sched.num_swapped_blocks_out,
            swapped_blocks_in=sched.num_swapped_blocks_in,
            swap_fallbacks=sched.num_swap_fallbacks,
            swap_time_s=swap_time,
        )

    def _sample(self, series: TimeSeries, now: float) -> None:
        s = self.allocator.stats()
        total = s.num_total_slots or 1
        series.time_s.append(now)
        series.running.append(self.scheduler.num_running)
        series.waiting.append(self.scheduler.num_waiting)
        series.kv_utilization.append(s.used_slots / total)
        series.fragmentation_frac.append(s.internal_fragmentation_slots / total)
        series.reserved_unused_frac.append(s.reserved_unused_slots / total)
        series.cached_frac.append(s.num_cached_blocks * s.block_size / total)
