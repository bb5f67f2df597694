"""The check that cannot drift: replay the device check's own engine runs (the engine
section's workload, ``sim/pagedkv_triton/check_data.EngineWorkload``) through the simulator on a clock,
and compare with the seconds the engine measured, eager and with CUDA graphs.

The replay is the engine's: the same Scheduler and allocator (``Simulation``), the same
requests (the trace's first records, prompts and outputs capped as that section capped
them, all at t = 0), the same limits and pool; only the model is the clock. The workload is rebuilt
from the trace, so it is checked first: its prompt and output token totals must equal what
the section reported (UsageError otherwise), and the step counts are reported beside the times.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.pagedkv_triton.check_data import EngineWorkload
from pagedkv.sim.simulator import Simulation
from pagedkv.traces import FreshSegments, TraceRequest, load_trace, require_shared_trace

MODES = ("eager", "cuda_graphs")


def workload_requests(w: EngineWorkload, trace: str | Path | None = None) -> list[TraceRequest]:
    """Section 4's requests: ``trace`` (default: the shared trace the workload names), its first
    ``w.requests`` records, prompts capped at ``w.max_prompt`` and outputs at ``w.max_output``
    (at least 1 each), all at t = 0. UsageError when the totals differ from the check's."""
    path = Path(trace) if trace is not None else require_shared_trace(w.trace)
    fresh, out = FreshSegments(), []
    for r in load_trace(path, w.requests):
        prompt = min(max(r.prompt_len_tokens, 1), w.max_prompt)
        out.append(
            TraceRequest(0.0, fresh.take(prompt), min(max(r.output_len_tokens, 1), w.max_output))
        )
    prompt_tokens = sum(r.prompt_len_tokens for r in out)
    output_tokens = sum(r.output_len_tokens for r in out)
    if (len(out), prompt_tokens, output_tokens) != (w.requests, w.prompt_tokens, w.output_tokens):
        raise UsageError(
            f"{path}: its first {w.requests} records give {len(out)} requests of "
            f"{prompt_tokens} prompt and {output_tokens} output tokens; the check ran "
            f"{w.prompt_tokens} and {w.output_tokens}: not the workload it measured"
        )
    return out


def replay(w: EngineWorkload, requests: list[TraceRequest], cost: CostModel) -> Any:
    """One simulated run of the workload on ``cost`` (a ``RunResult``)."""
    scheduler = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
    )
    # The engine's usable blocks + the null block, as build_parts gives its allocator.
    slots = (w.num_blocks + 1) * w.block_size
    policy = get_policy(w.policy).with_block_size(w.block_size)
    return Simulation(requests, policy, slots, scheduler, cost).run()


def check_runs(
    w: EngineWorkload,
    requests: list[TraceRequest],
    measured_s: dict[str, float],
    measured_steps: dict[str, int],
    costs: Mapping[str, CostModel],
) -> dict[str, dict[str, Any]]:
    """Per mode measured (``costs`` maps a mode to its clock): measured and predicted seconds,
    ``rel_err = predicted / measured - 1``, steps of each."""
    out = {}
    for mode, cost in costs.items():
        if mode not in measured_s:
            continue
        run = replay(w, requests, cost)
        out[mode] = {
            "measured_s": measured_s[mode],
            "predicted_s": run.duration_s,
            "rel_err": run.duration_s / measured_s[mode] - 1.0,
            "steps": {"engine": measured_steps.get(mode, 0), "simulator": run.num_steps},
            "preemptions": run.preemptions,
        }
    return out
