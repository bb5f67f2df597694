"""The fitted GPU clocks pagedkv ships, of two kinds, and which one a GPU uses.

- ``vllm-class`` (``presets/clocks/<GPU>.json``, ``sim/vllm_class/clock.GPUClock``): ``pagedkv
  calibrate --data`` on Vidur's published profiles, the reference for a vLLM-class engine
  (cuBLAS GEMMs, fused kernels, FlashAttention over a block table, vLLM's CPU overhead).
- ``pagedkv-triton`` (``presets/clocks/pagedkv-triton/<GPU>.json``,
  ``sim/pagedkv_triton/clock.EngineClock``): ``pagedkv calibrate --from-gpu-check`` on a device check
  of pagedkv's own engine on that GPU (its Triton kernels and its host loop).

A GPU with a clock of its own uses it. Another borrows the clock of its architecture's fitted
GPU of that kind (``BORROW``, ``ENGINE_BORROW``): the efficiencies and fixed costs carry over,
the rates and SM count are its own datasheet's. That is an assumption (same kernels, same
launch path, efficiency that depends on the architecture more than on the board); the
returned ``source`` says so.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from pagedkv.errors import UsageError, read_json
from pagedkv.sim.gpus import GPUSpec
from pagedkv.sim.pagedkv_triton.clock import EngineClock, is_engine_clock, parse_engine_clock
from pagedkv.sim.vllm_class.clock import GPUClock
from pagedkv.sim.vllm_class.fit import parse_clock, read_clock

VLLM_CLASS = (
    "a vLLM-class engine: Vidur's profiles (cuBLAS GEMMs, vLLM's fused kernels, FlashAttention "
    "over a block table, vLLM's CPU overhead)"
)
KINDS = ("vllm-class", "pagedkv-triton")
ENGINE_DIR = "pagedkv-triton"
# architecture -> the preset GPU whose fitted clock it borrows (Ada and Ampere share the SM
# design generation most closely; Blackwell inherits Hopper's until one is measured)
BORROW = {
    "ampere": "A100-80GB",
    "ada": "A100-80GB",
    "hopper": "H100-80GB",
    "blackwell": "H100-80GB",
}
ENGINE_BORROW = {"hopper": "H200-141GB"}  # pagedkv's engine was measured on an H200 only


def _dir() -> Path:
    return Path(str(resources.files("pagedkv") / "presets" / "clocks"))


def shipped() -> list[str]:
    """The GPU names with a shipped vLLM-class clock."""
    return sorted(p.stem for p in _dir().glob("*.json"))


def shipped_engine() -> list[str]:
    """The GPU names with a shipped pagedkv-triton clock."""
    return sorted(p.stem for p in (_dir() / ENGINE_DIR).glob("*.json"))


@cache
def _load(name: str) -> tuple[GPUClock, str]:
    path = _dir() / f"{name}.json"
    clock, meta = read_clock(path)
    files = meta.get("fitted_on", [])
    return (
        clock,
        f"vLLM-class reference clock {path.name} (fitted on {len(files)} Vidur profile files)",
    )


@cache
def _load_engine(name: str) -> tuple[EngineClock, str]:
    path = _dir() / ENGINE_DIR / f"{name}.json"
    data = json.loads(path.read_text())
    clock, meta = parse_engine_clock(data, str(path))
    return clock, f"pagedkv-triton clock {ENGINE_DIR}/{path.name} ({engine_fitted_on(meta)})"


def engine_fitted_on(meta: dict) -> str:
    """What an engine clock was fitted on, as its file records it: the device and the kernels
    its ledger timed (a clock of kernels main no longer runs says so)."""
    kernels = meta.get("kernels")
    return f"fitted on {meta.get('device', '?')}" + (f"; kernels: {kernels}" if kernels else "")


def clock_for(gpu: GPUSpec, clock_file: str | None = None) -> tuple[GPUClock, str]:
    """The vLLM-class clock ``gpu`` is priced with and a line saying where it comes from:
    ``clock_file`` when given (a ``pagedkv calibrate --data`` output), else the shipped one
    (module docstring)."""
    if clock_file is not None:
        clock, meta = read_clock(clock_file)
        return clock, f"clock {clock_file} (fitted for {meta.get('gpu', '?')})"
    if gpu.name in shipped():
        return _load(gpu.name)
    donor = BORROW.get(gpu.arch)
    if donor is None or donor not in shipped():
        raise UsageError(f"no fitted clock for {gpu.name} ({gpu.arch}); give --clock FILE")
    clock, source = _load(donor)
    return clock, f"{source}, borrowed for {gpu.name} ({gpu.arch}; assumed)"


def engine_clock_for(gpu: GPUSpec) -> tuple[EngineClock, str]:
    """The shipped pagedkv-triton clock of ``gpu``, or its architecture's (module docstring);
    UsageError naming the GPUs measured when there is none."""
    if gpu.name in shipped_engine():
        return _load_engine(gpu.name)
    donor = ENGINE_BORROW.get(gpu.arch)
    if donor is None or donor not in shipped_engine():
        measured = ", ".join(shipped_engine()) or "none"
        raise UsageError(
            f"no pagedkv-triton clock for {gpu.name} ({gpu.arch}; measured: "
            f"{measured}); give --clock FILE from `pagedkv calibrate "
            "--from-gpu-check`"
        )
    clock, source = _load_engine(donor)
    return clock, f"{source}, borrowed for {gpu.name} ({gpu.arch}; assumed)"


def read_any_clock(path: str) -> tuple[str, GPUClock | EngineClock, str]:
    """A clock file of either kind: (kind, clock, a line naming it). UsageError otherwise."""
    data = read_json(path, "GPU clock")
    if is_engine_clock(data):
        clock, meta = parse_engine_clock(data, path)
        return (
            "pagedkv-triton",
            clock,
            f"pagedkv-triton clock {path} ({engine_fitted_on(meta)})",
        )
    vllm, meta = parse_clock(data, path)
    return "vllm-class", vllm, f"vLLM-class clock {path} (fitted for {meta.get('gpu', '?')})"


def resolve_clock(gpu: GPUSpec, clock: str | None) -> tuple[str, GPUClock | EngineClock, str]:
    """What ``--clock`` names: None or ``vllm-class`` the shipped vLLM-class clock of ``gpu``,
    ``pagedkv-triton`` its shipped pagedkv clock, anything else a clock file of either kind.
    Returns (kind, clock, a line naming it)."""
    if clock is None or clock == "vllm-class":
        vllm, source = clock_for(gpu)
        return "vllm-class", vllm, source
    if clock == "pagedkv-triton":
        engine, source = engine_clock_for(gpu)
        return "pagedkv-triton", engine, source
    return read_any_clock(clock)


__all__ = [
    "BORROW",
    "KINDS",
    "clock_for",
    "engine_clock_for",
    "parse_clock",
    "read_any_clock",
    "resolve_clock",
    "shipped",
    "shipped_engine",
]
