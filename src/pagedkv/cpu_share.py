"""How many threads the next step should run: the cores other processes left free lately.

Why: every op of a step ends at a barrier of torch's OpenMP team (pagedkv's kernels run on the
same count). When another process holds the core one of the threads needs, the whole step
waits for that thread, so beside one CPU-burning process two threads ran the trace slower than
one (docs/latency.md, eighth round). ``CpuShare`` looks at the machine's busy time in
``/proc/stat`` minus this process's own CPU time (``os.times``: its threads' spinning counts
as its own) over a window of at least ``window_s``, and answers the cores left free, rounded,
between 1 and the count the engine started with.

The count changes only which thread computes which part of an output, never the arithmetic
(``model/projection.keep_shards`` keeps the column shards of the prompts' GEMMs): the tokens do not
depend on the machine's load. Torch-free: the engine's runner applies the answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

# Half a core of others' work takes a thread away (2 threads beside a burner: others ~0.7).
WINDOW_S = 0.25


class Sample(NamedTuple):
    """Cumulative seconds at one moment: the machine's busy time (all cores), this process's
    CPU time, and the wall clock."""

    machine_busy_s: float
    own_s: float
    wall_s: float


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def read_sample() -> Sample | None:
    """The machine's busy time from ``/proc/stat`` (user, nice, system, irq, softirq; idle,
    iowait and steal are not another process holding a core), or None where there is none."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 8 or fields[0] != b"cpu":
        return None
    try:
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    except ValueError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    times = os.times()
    busy_s = (user + nice + system + irq + softirq) / ticks
    return Sample(busy_s, times.user + times.system, time.monotonic())


def free_threads(before: Sample, now: Sample, cores: int, ceiling: int) -> int:
    """The threads to run after the window ``before`` -> ``now``: ``cores`` less the cores the
    other processes kept busy on average, rounded to the nearest, within [1, ``ceiling``]."""
    wall = now.wall_s - before.wall_s
    if wall <= 0:
        return ceiling
    others = (now.machine_busy_s - before.machine_busy_s) - (now.own_s - before.own_s)
    left = cores - max(0.0, others) / wall
    return max(1, min(ceiling, int(left + 0.5)))


class CpuShare:
    """Answers ``threads()`` before each step: ``ceiling`` until a first window of
    ``window_s`` has passed, then the last window's ``free_threads``. ``sample`` is injectable
    (tests); where it answers None (no ``/proc/stat``), always ``ceiling``."""

    def __init__(
        self,
        ceiling: int,
        cores: int,
        window_s: float = WINDOW_S,
        sample: Callable[[], Sample | None] = read_sample,
    ) -> None:
        if ceiling < 1 or cores < 1:
            raise ValueError(f"ceiling and cores must be >= 1, got {ceiling}, {cores}")
        self.ceiling, self.cores, self.window_s = ceiling, cores, window_s
        self._sample = sample
        self._since = sample()
        self._threads = ceiling

    def threads(self) -> int:
        if self._since is None:
            return self.ceiling
        now = self._sample()
        if now is None:
            return self.ceiling
        if now.wall_s - self._since.wall_s >= self.window_s:
            self._threads = free_threads(self._since, now, self.cores, self.ceiling)
            self._since = now
        return self._threads
