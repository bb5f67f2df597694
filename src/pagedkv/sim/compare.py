"""Run one trace under several policies and block sizes: the core of ``pagedkv simulate``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.kvcache.policies import Policy, get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.links import DeviceCopy, Link
from pagedkv.sim.simulator import ProgressFn, RunResult, Simulation
from pagedkv.sim.summary import ideal_hits, summarize
from pagedkv.traces import TraceRequest, reusable_prefix_tokens


def expand_policies(
    names: Sequence[str], block_sizes: Sequence[int] = (), units: Sequence[int | None] = ()
) -> list[Policy]:
    """Each named policy at each block size (``reserved`` once: it has no block size), and each
    one with a prefix cache at each prefix match unit (None: whole blocks), in the given order,
    without duplicates. ValueError for an unknown name, or a unit a policy with a prefix cache
    cannot take at its block size (a policy without one has nothing to match: run as it is)."""
    policies: list[Policy] = []
    for name in names:
        base = get_policy(name)
        variants = [base] if not block_sizes else [base.with_block_size(b) for b in block_sizes]
        for sized in variants:
            for p in _with_units(sized, units):
                if p not in policies:
                    policies.append(p)
    return policies


def _with_units(policy: Policy, units: Sequence[int | None]) -> list[Policy]:
    if not units or not policy.prefix_caching or policy.block_size is None:
        return [policy]
    out = []
    for unit in units:
        p = policy.with_prefix_match_unit(unit if unit is not None else policy.block_size)
        problem = p.unit_problem()
        if problem is not None:
            raise ValueError(f"--prefix-match-unit: {policy.name}: {problem}")
        out.append(p)
    return out


@dataclass(frozen=True)
class Comparison:
    """A set of runs over one trace and pool."""

    requests: Sequence[TraceRequest]
    num_kv_slots: int
    config: SchedulerConfig
    cost: CostModel
    sample_interval_s: float = 1.0
    check_invariants: bool = False  # tests: check the allocator after every step
    link: Link | None = None  # prices swap transfers (swap preemption needs it)
    kv_record_bytes: int = 0  # one token's K and V over all layers: block bytes for swaps
    transfers_per_block: int = 1  # 2 * num_layers for per-layer K/V tensors (vLLM v0)
    device_copy: DeviceCopy | None = None  # prices partial prefix hits' copies

    def run(
        self,
        policies: Sequence[Policy],
        progress: Callable[[Policy], ProgressFn | None] | None = None,
    ) -> list[tuple[RunResult, dict[str, Any]]]:
        """One ``Simulation`` per policy; each summary carries the ideal prefix hits of its
        block size (over the requests that were not refused)."""
        out: list[tuple[RunResult, dict[str, Any]]] = []
        reusable = reusable_prefix_tokens(self.requests)
        for policy in policies:
            sim = Simulation(
                self.requests,
                policy,
                self.num_kv_slots,
                self.config,
                self.cost,
                sample_interval_s=self.sample_interval_s,
                progress=progress(policy) if progress else None,
                check_invariants=self.check_invariants,
                link=self.link,
                kv_record_bytes=self.kv_record_bytes,
                transfers_per_block=self.transfers_per_block,
                device_copy=self.device_copy,
            )
            result = sim.run()
            ideal = None
            if policy.prefix_caching:
                unit = policy.prefix_match_unit or result.block_size
                ideal = ideal_hits(self.requests, result.records, unit, reusable)
            out.append((result, summarize(result, ideal)))
        return out
