"""``Cluster``: N simulated engines behind a router: ``pagedkv simulate --replicas N --router``.

Each replica is a ``Replica`` (``sim/replica.py``: its own scheduler, allocator and clock, the
same step as the one-engine ``Simulation``). The router is the routing package's own code
(``pagedkv.routing``: ``build_policy`` and a ``PrefixIndex``), fed the way a real router is fed:
each replica's KV events are drained after each of its steps and applied to the index.

The clock is a discrete-event loop over the replicas' step boundaries and the arrivals, in
time order (an arrival first on a tie, as one engine admits arrivals at ``now`` before its
step):

* an arrival is routed at its arrival time. The policy sees each replica's load as running +
  waiting + routed-but-not-yet-admitted, and the index as of the replica's latest step. A
  step is computed whole when it starts (its events are applied then), so for an arrival
  during a step the router already sees that step's outcome: the index and the load can be
  up to one step early, as a real router fed by events can be a step early or late;
* the chosen replica takes the request at its next step boundary at or after the arrival (an
  idle replica at the arrival time itself).

With one replica this is exactly ``Simulation`` (tests check every record). Nothing is random:
a run is a pure function of its inputs (ties between replicas are broken in turn).
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import Policy
from pagedkv.routing import PrefixIndex, ReplicaLoad, build_policy, prompt_block_hashes
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.links import DeviceCopy, Link
from pagedkv.sim.metrics import RequestRecord, RunResult
from pagedkv.sim.replica import ProgressFn, Replica
from pagedkv.traces import TraceRequest, segment_tokens


@dataclass
class ClusterResult:
    """One cluster run. ``replicas[r].records``: the requests replica ``r`` served (trace
    order); ``records``: all of them (trace order); ``served_by[i]``: the replica index of
    request ``i``; ``decisions``: routing reasons (``RouteDecision.reason``) counted;
    ``running_time``: per replica, the integral of running sequences over simulated time."""

    router: str
    policy: Policy
    replicas: list[RunResult]
    records: list[RequestRecord]
    served_by: list[int]
    decisions: dict[str, int]
    running_time: list[float]
    duration_s: float
    wall_time_s: float
    num_index_events: int

    @property
    def load_imbalance(self) -> float | None:
        """Max over replicas of time-mean running / the mean over replicas of it (1.0 = even;
        None when nothing ran)."""
        mean = sum(self.running_time) / len(self.running_time)
        return max(self.running_time) / mean if mean > 0 else None


@dataclass
class _Replay:
    """A cluster run between two events: the requests routed to each replica and not yet
    admitted, which replicas are busy, their next step boundaries, where each request went."""

    pending: list[list[tuple[int, array]]]  # per replica: (request, prompt ids)
    busy: list[bool]
    heap: list[tuple[float, int]]  # (next step boundary, replica) of busy replicas
    served_by: list[int]
    decisions: Counter[str]
    next_req: int = 0  # the next arrival to route
    num_done: int = 0  # requests finished or refused
    next_progress_s: float = 0.0

    @classmethod
    def start(cls, num_requests: int, num_replicas: int) -> _Replay:
        """Before the first arrival: every replica idle, nothing routed."""
        return cls(
            pending=[[] for _ in range(num_replicas)],
            busy=[False] * num_replicas,
            heap=[],
            served_by=[-1] * num_requests,
            decisions=Counter(),
        )


class Cluster:
    """``Cluster(requests, policy, num_kv_slots, config, cost, num_replicas, router).run()``:
    ``num_replicas`` engines of ``policy`` with ``num_kv_slots`` each, behind ``router`` (a
    name of ``pagedkv.routing.ROUTING_POLICIES``). Other arguments as ``Simulation``'s;
    ``check_invariants`` (tests) also checks after every step that the index holds exactly
    each replica's ``allocator.prefix_hashes()``."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        policy: Policy,
        num_kv_slots: int,
        config: SchedulerConfig,
        cost: CostModel,
        num_replicas: int,
        router: str,
        *,
        balance_abs: int = 4,
        balance_rel: float = 0.25,
        sample_interval_s: float = 1.0,
        progress: ProgressFn | None = None,
        check_invariants: bool = False,
        link: Link | None = None,
        kv_record_bytes: int = 0,
        transfers_per_block: int = 1,
        device_copy: DeviceCopy | None = None,
    ) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise UsageError(f"replicas must be an integer >= 1, got {num_replicas!r}")
        self.router = build_policy(router, balance_abs=balance_abs, balance_rel=balance_rel)
        self.requests = requests
        self.policy = policy
        self.records = [RequestRecord(r.arrival_time_s, r.prompt_len_tokens) for r in requests]
        # The index only matters to a policy that reads it, over caches that exist.
        self.use_index = self.router.uses_prefix_index and policy.prefix_caching
        events = self.use_index or check_invariants
        self.replicas = [
            Replica(
                policy,
                num_kv_slots,
                config,
                cost,
                self.records,
                sample_interval_s=sample_interval_s,
                link=link,
                kv_record_bytes=kv_record_bytes,
                transfers_per_block=transfers_per_block,
                events=events,
                device_copy=device_copy,
            )
            for _ in range(num_replicas)
        ]
        self.names = [f"r{r}" for r in range(num_replicas)]
        self._slot = {name: r for r, name in enumerate(self.names)}
        self.block_size = self.replicas[0].allocator.block_size
        self.index = PrefixIndex()
        self.progress = progress
        self.check_invariants = check_invariants

    def _matched(self, tokens: Sequence[int], block_size: int) -> dict[str, int]:
        """Replica -> its cached prefix of ``tokens`` for the router: whole blocks, or tokens
        when the replicas reuse partial blocks (their events carry token ids)."""
        hashes = prompt_block_hashes(tokens, block_size)
        unit = self.policy.prefix_match_unit
        if unit is None or unit >= block_size:
            return self.index.match(hashes)
        return self.index.match_tokens(hashes, tokens, block_size)

    def run(self) -> ClusterResult:
        """Replay every request once (build a new ``Cluster`` for another run)."""
        wall_start = time.perf_counter()
        for name, rep in zip(self.names, self.replicas, strict=True):
            if rep.events is not None:  # the fresh engines' AllBlocksCleared
                self.index.apply(name, rep.events.drain())
        replay = _Replay.start(len(self.requests), len(self.replicas))
        reqs, num_reqs = self.requests, len(self.requests)
        while True:
            top = replay.heap[0][0] if replay.heap else math.inf
            if replay.next_req < num_reqs and reqs[replay.next_req].arrival_time_s <= top:
                self._route_next(replay)
                continue
            if not replay.heap:
                break
            self._step_next(replay)
        if self.progress is not None:
            self.progress(replay.num_done, max(rep.now for rep in self.replicas))
        wall_s = time.perf_counter() - wall_start
        return self._result(replay.served_by, dict(replay.decisions), wall_s)

    def _route_next(self, replay: _Replay) -> None:
        """Route the next arrival by the router's choice over the replicas' loads and cached
        prefixes; an idle replica wakes at the arrival time."""
        i = replay.next_req
        req = self.requests[i]
        replay.next_req += 1
        tokens = segment_tokens(req.prompt)
        matched = self._matched(tokens, self.block_size) if self.use_index else {}
        loads = [
            ReplicaLoad(name, rep.scheduler.num_running + rep.scheduler.num_waiting + len(p))
            for name, rep, p in zip(self.names, self.replicas, replay.pending, strict=True)
        ]
        decision = self.router.choose(loads, matched)
        replay.decisions[decision.reason] += 1
        r = replay.served_by[i] = self._slot[decision.replica]
        replay.pending[r].append((i, tokens))
        if not replay.busy[r]:
            replay.busy[r] = True
            rep = self.replicas[r]
            rep.now = max(rep.now, req.arrival_time_s)
            heapq.heappush(replay.heap, (rep.now, r))

    def _step_next(self, replay: _Replay) -> None:
        """The replica with the earliest step boundary admits what was routed to it and runs
        one step (its KV events then feed the index); it idles once it has no work left."""
        _, r = heapq.heappop(replay.heap)
        rep, name = self.replicas[r], self.names[r]
        for i, tokens in replay.pending[r]:
            replay.num_done += not rep.admit(i, self.requests[i], tokens)
        replay.pending[r].clear()
        if rep.scheduler.has_unfinished():
            replay.num_done += rep.step()
            if rep.events is not None:
                self.index.apply(name, rep.events.drain())
            if self.check_invariants:
                rep.scheduler.check_invariants()
                assert self.index.holds(name) == rep.allocator.prefix_hashes(), name
        if rep.scheduler.has_unfinished():
            heapq.heappush(replay.heap, (rep.now, r))
        else:
            replay.busy[r] = False
        if self.progress is not None and rep.now >= replay.next_progress_s:
            self.progress(replay.num_done, rep.now)
            replay.next_progress_s = rep.now + 1.0

    def _result(
        self, served_by: list[int], decisions: dict[str, int], wall_s: float
    ) -> ClusterResult:
        reps, records = self.replicas, self.records
        start_s = self.requests[0].arrival_time_s if self.requests else 0.0
        duration = max(rep.now for rep in reps) - start_s
        mine: list[list[RequestRecord]] = [[] for _ in reps]
        for rec, r in zip(records, served_by, strict=True):
            mine[r].append(rec)
        return ClusterResult(
            router=self.router.name,
            policy=self.policy,
            replicas=[rep.result(m, duration, wall_s) for rep, m in zip(reps, mine, strict=True)],
            records=records,
            served_by=served_by,
            decisions=decisions,
            running_time=[rep.running_time for rep in reps],
            duration_s=duration,
            wall_time_s=wall_s,
            num_index_events=self.index.num_events,
        )
