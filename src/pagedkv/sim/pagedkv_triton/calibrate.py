"""``calibrate_engine``: a clock of pagedkv's own engine from one device check, fitted on kernels
and steps and checked on whole runs (``pagedkv calibrate --from-gpu-check``, and the device
check's last section, ``benchmarks/gpu_check_clock.py``).

The story, part by part (each recorded in the clock's ``sources``):

1. decode attention: every law of ``sim/pagedkv_triton/decode_law.py`` fitted to the ledger rows, scored by
   leave-one-context-out cross-validation; the best one is the clock's;
2. GEMMs: borrowed from the vLLM-class clock of the GPU (cuBLAS is both engines' library; the
   check times no GEMM alone, and the steps cannot tell a projection's time from the host's);
3. the steps (``sim/pagedkv_triton/fit.py``): the host's work first where the check timed host-only
   steps; then the prefill kernel, other kernels, launches eager and what a CUDA graph replay
   costs, fitted to the timed steps with 1-2 (and the host) held fixed;
4. the check: the engine section's runs replayed on the clock, eager and with graphs, when the
   workload's trace is at hand (``sim/pagedkv_triton/check.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.pages.shape import ModelShape
from pagedkv.sim.cost_model import ModelCost
from pagedkv.sim.pagedkv_triton.check import check_runs, workload_requests
from pagedkv.sim.pagedkv_triton.check_data import GPUCheckData, read_gpu_check
from pagedkv.sim.pagedkv_triton.clock import EngineClock
from pagedkv.sim.pagedkv_triton.cost import EngineCostModel
from pagedkv.sim.pagedkv_triton.decode_law import LawScore, choose_law
from pagedkv.sim.pagedkv_triton.fit import STARTS, fit_host, fit_steps, host_report, step_report


@dataclass(frozen=True)
class Calibration:
    clock: EngineClock
    meta: dict[str, Any]  # what the clock file records beside the parameters: fits, checks
    data: GPUCheckData  # what it was fitted to
    model: ModelCost


def model_cost(data: GPUCheckData) -> ModelCost:
    """The engine section's model: its recorded shape, else the preset it names."""
    from pagedkv.pages.sources import load_shape

    if data.model_shape is not None:
        try:
            shape = ModelShape(**{"source": "preset", "origin": data.source, **data.model_shape})
        except (TypeError, UsageError) as exc:
            raise UsageError(f"{data.source}: sections.clock.model_shape: {exc}") from None
        return ModelCost.from_shape(shape)
    return ModelCost.from_shape(load_shape(data.model))


def base_clock(data: GPUCheckData, decode_law: str, decode: dict[str, float]) -> EngineClock:
    """The clock before the steps are fitted: the chosen decode law, the GPU's vLLM-class GEMM
    law, starting values for the rest."""
    from pagedkv.sim.clock_presets import clock_for

    vllm, vllm_source = clock_for(data.gpu)
    block_sizes = {r.call.block_size for r in data.ledger}
    ref = min({s.shape.block_size for s in data.eager_steps} or block_sizes)
    sources = {
        "decode_attention": f"fitted on {len(data.ledger)} ledger rows of {data.source}",
        "gemm": f"borrowed: {vllm_source}",
    }
    return EngineClock(
        gpu=data.gpu.name,
        decode_law=decode_law,
        decode=decode,
        ref_block_size=ref,
        gemm_launch_s=vllm.gemm_launch_s,
        gemm_bw_eff=vllm.gemm_bw_eff,
        gemm_flops_eff=vllm.gemm_flops_eff,
        gemm_knee=vllm.gemm_knee,
        sources=sources,
        **{k: v for k, v in STARTS.items()},
    )


def calibrate_engine(
    path: str | Path,
    gpu: str | None = None,
    trace: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    sections: dict[str, Any] | None = None,
) -> Calibration:
    """The clock of the engine the device check at ``path`` measured (module docstring).
    ``trace``: the workload's trace file (default: the shared one it names; the run check is
    left out, and says so, when neither is at hand); ``sections``: records taken as part of
    the file (``read_gpu_check``). UsageError for an unusable check; ImportError without
    numpy/scipy."""
    say = progress or (lambda _line: None)
    data = read_gpu_check(path, gpu, sections)
    model = model_cost(data)
    clock, scores = _fit_clock(data, model, say)
    meta: dict[str, Any] = {
        "fitted_on": data.source,
        "device": data.device_name,
        "kernels": data.kernels,
        "model": model.name,
        "decode_laws": [asdict(s) for s in scores],
        "steps": _step_reports(clock, model, data),
    }
    meta["runs"] = check_engine_runs(data, clock, model, trace, say)
    return Calibration(clock, meta, data, model)


def _fit_clock(
    data: GPUCheckData, model: ModelCost, say: Callable[[str], None]
) -> tuple[EngineClock, list[LawScore]]:
    """The decode law (chosen by leave-one-context-out), then the host, then the steps, each
    on what it is fitted to, with its sources saying so; and every law's scores."""
    say(f"fitting decode attention: {len(data.ledger)} ledger rows, laws by leave-one-context-out")
    chosen, scores = choose_law(data.ledger, data.gpu)
    clock = base_clock(data, chosen.law, chosen.params)
    if data.host_steps:
        say(f"fitting the host: {len(data.host_steps)} host-only steps")
        clock = fit_host(clock, data.host_steps)
        host_note = f"fitted on {len(data.host_steps)} host-only steps of {data.source}"
    else:
        host_note = (
            f"fitted with the eager steps of {data.source} (no host-only step timed: "
            "per step and per sequence only; per table entry and per token not "
            "measured, 0)"
        )
    say(f"fitting steps: {len(data.eager_steps)} eager, {len(data.graph_steps)} with CUDA graphs")
    clock = fit_steps(
        clock, model, data.gpu, data.eager_steps, data.graph_steps, host_fixed=bool(data.host_steps)
    )
    return _with_step_sources(clock, data, host_note), scores


def _with_step_sources(clock: EngineClock, data: GPUCheckData, host_note: str) -> EngineClock:
    """``clock`` with the sources of what the timed steps fitted (or what was borrowed)."""
    steps_note = f"fitted on {len(data.eager_steps)} timed eager steps of {data.source}"
    graphs_note = (
        f"fitted on {len(data.graph_steps)} timed CUDA-graph steps of {data.source}"
        if data.graph_steps
        else "borrowed: no CUDA-graph step was timed; a replay assumed to remove exactly the eager "
        f"launches fitted above and cost {clock.graph_replay_s * 1e3:g} ms"
    )
    return replace(
        clock,
        sources={
            **clock.sources,
            "prefill_attention": steps_note,
            "elementwise": steps_note,
            "host": host_note,
            "host_eager": steps_note,
            "host_graphs": graphs_note,
        },
    )


def _step_reports(clock: EngineClock, model: ModelCost, data: GPUCheckData) -> dict[str, Any]:
    """The fitted clock against the timed steps: eager, with CUDA graphs, host-only."""
    steps = {"eager": step_report(clock, model, data.gpu, data.eager_steps, False)}
    if data.graph_steps:
        steps["cuda_graphs"] = step_report(clock, model, data.gpu, data.graph_steps, True)
    if data.host_steps:
        steps["host_only"] = host_report(clock, model, data.gpu, data.host_steps)
    return steps


def check_engine_runs(
    data: GPUCheckData,
    clock: EngineClock,
    model: ModelCost,
    trace: str | Path | None,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Section 4's runs on ``clock``, or ``{"skipped": why}``."""
    if data.workload is None or not data.runs:
        return {"skipped": "the check has no engine run"}
    try:
        requests = workload_requests(data.workload, trace)
    except UsageError as exc:
        return {"skipped": str(exc)}
    say(f"replaying the engine section's {len(requests)} requests on the clock, eager and graphs")
    costs = {
        mode: EngineCostModel(model, data.gpu, clock, cuda_graphs=mode == "cuda_graphs")
        for mode in ("eager", "cuda_graphs")
    }
    return check_runs(data.workload, requests, data.runs, data.run_steps, costs)
