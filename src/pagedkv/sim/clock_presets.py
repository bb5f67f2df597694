"""The fitted GPU clocks pagedkv ships (``presets/clocks/<GPU>.json``, written by
``pagedkv calibrate`` from the measured profiles named in each file), and which one a GPU uses.

A GPU with a clock of its own uses it. Another borrows the clock of its architecture's fitted
GPU (``BORROW``): the efficiencies and fixed costs carry over, the rates and SM count are its
own datasheet's. That is an assumption (same kernels, same launch path, efficiency that
depends on the architecture more than on the board); the returned ``source`` says so.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

from pagedkv.errors import UsageError
from pagedkv.sim.clock_fit import parse_clock, read_clock
from pagedkv.sim.gpu_clock import GPUClock
from pagedkv.sim.gpus import GPUSpec

# architecture -> the preset GPU whose fitted clock it borrows (Ada and Ampere share the SM
# design generation most closely; Blackwell inherits Hopper's until one is measured)
BORROW = {
    "ampere": "A100-80GB",
    "ada": "A100-80GB",
    "hopper": "H100-80GB",
    "blackwell": "H100-80GB",
}


def _dir() -> Path:
    return Path(str(resources.files("pagedkv") / "presets" / "clocks"))


def shipped() -> list[str]:
    """The GPU names with a shipped clock."""
    return sorted(p.stem for p in _dir().glob("*.json"))


@cache
def _load(name: str) -> tuple[GPUClock, str]:
    path = _dir() / f"{name}.json"
    clock, meta = read_clock(path)
    files = meta.get("fitted_on", [])
    return clock, f"{path.name} (fitted on {len(files)} measured profile files)"


def clock_for(gpu: GPUSpec, clock_file: str | None = None) -> tuple[GPUClock, str]:
    """The clock ``gpu`` is priced with and a line saying where it comes from: ``clock_file``
    when given (a ``pagedkv calibrate`` output), else the shipped one (module docstring)."""
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


__all__ = ["BORROW", "clock_for", "parse_clock", "shipped"]
