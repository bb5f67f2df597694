"""What a device check's JSON (``benchmarks/gpu_check.py --output``) holds for a clock of
pagedkv's engine, read and checked (UsageError naming the file for anything unusable):

- ``ledger``: decode attention rows ``{block_size, context_len, batch, num_splits, median_ms}``
  at the section's ``shape`` ``{num_kv_heads, head_dim, dtype}`` (rows that were refused,
  skipped or failed carry no ``median_ms`` and are left out). A row's ``layout`` (checks from
  the tile kernels on, commit cf28990) says what it timed: ``paged`` (the default: the first
  H200 check's rows have no layout) or ``contiguous`` (one block of the whole context a
  sequence, ``block_size = context_len``): the latter are kept apart (``contiguous``), never
  taken for paged rows of B = context; the section's ``prefill`` and ``paged_over_contiguous``
  are not read;
- timed engine steps: eager ones from the profile_sim section's cost profile (the ``samples`` of
  ``<output>.cost_profile.json`` beside the JSON, or the ``clock`` section's ``eager_steps``),
  CUDA-graph ones from the ``clock`` section's ``graph_steps``: ``StepShape`` fields +
  ``seconds``, and, where the check recorded it, ``max_context_tokens`` (then the step is a
  ``sim/pagedkv_triton/step_context.LongestShape``); ``STEP_NOTES`` are what a step may carry beside them
  for people, not read; host-only steps (the engine's steps with the model's forward removed:
  schedule, inputs, sampling, outputs) from the ``clock`` section's ``host_steps``, each with
  its ``max_context_tokens``;
- the engine section's runs (``pagedkv.eager`` / ``pagedkv.cuda_graphs``: ``seconds``,
  ``steps``, ``num_blocks``) and their workload: the ``clock`` section's ``workload`` record,
  or, for a check from before it (the first H200 check), ``ENGINE_SECTION_V1``, the sizes the
  engine section ran with then.

The GPU is the preset that ``meta.device_name`` names (``gpu=`` overrides it, e.g. for a dry
run on the CPU); the model's shape is the ``clock`` section's ``model_shape`` or the preset
the engine section names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError, read_json
from pagedkv.sched.step_shape import TimedStep
from pagedkv.sim.gpus import GPUSpec, get_gpu
from pagedkv.sim.pagedkv_triton.check_records import (
    finite_number,
    ledger_kernels,
    ledger_rows,
    timed_steps,
)
from pagedkv.sim.pagedkv_triton.decode_law import LedgerRow
from pagedkv.sim.pagedkv_triton.step_context import LongestShape

# benchmarks/gpu_check_run.DEVICE_SIZES of the engine section before it recorded its workload
ENGINE_SECTION_V1: dict[str, Any] = {
    "trace": "azure_llm_2023_conv.csv",
    "max_prompt": 2048,
    "max_output": 256,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "block_size": 16,
    "policy": "vllm",
    "model_len_margin": 16,
}


@dataclass(frozen=True)
class EngineWorkload:
    """How the engine section ran: the first ``requests`` of ``trace``, prompts and outputs capped,
    all at t = 0 (EOS ignored), on an engine of these limits; the token totals it reported."""

    trace: str
    requests: int
    max_prompt: int
    max_output: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    policy: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class GPUCheckData:
    source: str  # "<folder>/<file>": for the clock's sources (no machine's path)
    device_name: str
    gpu: GPUSpec
    model: str  # a preset name or "<section>" when the shape is in the JSON
    model_shape: dict[str, Any] | None
    ledger: tuple[LedgerRow, ...]  # paged rows: what the decode law is fitted to
    contiguous: tuple[LedgerRow, ...]  # the contiguous layout's rows (block = the context)
    kernels: str  # which decode kernel the ledger timed (``ledger_kernels``)
    eager_steps: tuple[TimedStep, ...]
    graph_steps: tuple[TimedStep, ...]
    host_steps: tuple[TimedStep, ...]
    runs: dict[str, float]  # "eager" / "cuda_graphs" -> measured seconds
    run_steps: dict[str, int]
    workload: EngineWorkload | None


def _section(data: dict, name: str) -> dict | None:
    """The result of section ``name`` if it ran (``ok``), else None."""
    entry = data.get("sections", {}).get(name)
    if (
        not isinstance(entry, dict)
        or not entry.get("ok")
        or not isinstance(entry.get("result"), dict)
    ):
        return None
    return entry["result"]


def _workload(engine: dict, clock: dict | None, where: str) -> EngineWorkload | None:
    """How the engine section ran (the clock section's record, else ``ENGINE_SECTION_V1``);
    None when it ran nothing."""
    runs = engine.get("pagedkv", {})
    if not runs:
        return None
    first = next(iter(runs.values()))
    if clock is not None and isinstance(clock.get("workload"), dict):
        w = clock["workload"]
        try:
            return EngineWorkload(**w)
        except TypeError as exc:
            raise UsageError(f"{where}: sections.clock.workload: {exc}") from None
    v1 = ENGINE_SECTION_V1
    return EngineWorkload(
        v1["trace"],
        int(engine["requests"]),
        v1["max_prompt"],
        v1["max_output"],
        v1["max_num_seqs"],
        v1["max_num_batched_tokens"],
        v1["max_prompt"] + v1["max_output"] + v1["model_len_margin"],
        v1["block_size"],
        int(first["num_blocks"]),
        v1["policy"],
        int(engine["prompt_tokens"]),
        int(engine["output_tokens"]),
    )


def read_gpu_check(
    path: str | Path, gpu: str | None = None, sections: dict[str, Any] | None = None
) -> GPUCheckData:
    """Everything above from the device check at ``path`` (module docstring); ``sections``
    (name -> a section's record) are taken as if the file held them too: the check's own
    clock section fits before its result is written."""
    path = Path(path)
    data = read_json(path, "device check")
    if sections and isinstance(data, dict) and isinstance(data.get("sections"), dict):
        data["sections"].update(sections)
    where = str(path)
    if not isinstance(data, dict) or not isinstance(data.get("sections"), dict):
        raise UsageError(
            f"{where}: not a device check (no 'sections'; see benchmarks/gpu_check.py)"
        )
    try:
        return _read(path, gpu, data, where)
    except UsageError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a field of another shape
        why = f"{type(exc).__name__}: {exc}"
        raise UsageError(f"{where}: not a device check as gpu_check.py writes it ({why})") from None


def _read(path: Path, gpu: str | None, data: dict[str, Any], where: str) -> GPUCheckData:
    """The check's sections as ``GPUCheckData``: the GPU, the ledger, the timed steps, the
    engine's runs; UsageError for what a clock cannot be fitted without."""
    device, spec = _device(data, gpu, where)
    ledger = _section(data, "ledger")
    if ledger is None:
        raise UsageError(f"{where}: no ledger section that ran: nothing to fit decode attention to")
    clock = _section(data, "clock")
    eager = _eager_steps(path, clock, where)
    graphs = _clock_steps(clock, "graph_steps", where)
    host = _clock_steps(clock, "host_steps", where)
    if any(not isinstance(s.shape, LongestShape) for s in host):
        at = f"{where}: sections.clock.host_steps"
        raise UsageError(f"{at}: every host-only step needs its max_context_tokens")
    engine = _section(data, "engine") or {}
    runs = {
        k: finite_number(v["seconds"], f"{where}: engine.pagedkv.{k}.seconds")
        for k, v in engine.get("pagedkv", {}).items()
    }
    run_steps = {k: int(v.get("steps", 0)) for k, v in engine.get("pagedkv", {}).items()}
    shape = clock.get("model_shape") if clock is not None else None
    model = "<sections.clock.model_shape>" if shape else str(engine.get("model", "llama-3-8b"))
    label = f"{path.resolve().parent.name}/{path.name}"
    paged = ledger_rows(ledger, where)
    if not paged:
        raise UsageError(
            f"{where}: the ledger timed no paged row: nothing to fit decode attention to"
        )
    return GPUCheckData(
        label,
        device,
        spec,
        model,
        shape,
        paged,
        ledger_rows(ledger, where, "contiguous"),
        ledger_kernels(ledger),
        eager,
        graphs,
        host,
        runs,
        run_steps,
        _workload(engine, clock, where),
    )


def _device(data: dict[str, Any], gpu: str | None, where: str) -> tuple[str, GPUSpec]:
    """The device the check ran on (``meta.device_name``) and the GPU preset that prices it
    (``gpu`` overrides the name)."""
    meta = data.get("meta")
    device = str((meta if isinstance(meta, dict) else {}).get("device_name", "?"))
    try:
        spec = get_gpu(gpu or device.removeprefix("NVIDIA ").strip())
    except UsageError:
        raise UsageError(
            f"{where}: device {device!r} is no GPU preset; name one with --gpu"
        ) from None
    return device, spec


def _clock_steps(clock: dict | None, key: str, where: str) -> tuple[TimedStep, ...]:
    """The clock section's timed steps under ``key`` (none without the section or the key)."""
    if clock is None or key not in clock:
        return ()
    return timed_steps(clock[key], f"{where}: sections.clock.{key}")


def _eager_steps(path: Path, clock: dict | None, where: str) -> tuple[TimedStep, ...]:
    """The eager steps: the clock section's, then the cost profile's beside the check; at
    least one (UsageError)."""
    eager = _clock_steps(clock, "eager_steps", where)
    profile = path.with_suffix(".cost_profile.json")
    if profile.is_file():
        try:
            samples = json.loads(profile.read_text()).get("samples")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise UsageError(f"cannot read cost profile {str(profile)!r}: {exc}") from None
        eager += timed_steps(samples, f"{profile}: samples")
    if not eager:
        raise UsageError(
            f"{where}: no timed eager steps (no {profile.name} beside it, no "
            "clock section): nothing to fit the steps to"
        )
    return eager
