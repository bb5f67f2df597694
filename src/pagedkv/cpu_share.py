"""How many threads the next step should run: the cores other processes left free lately.

Why: every op of a step ends at a barrier of torch's OpenMP team (pagedkv's kernels run on the
same count). When another process holds the core one of the threads needs, the whole step
waits for that thread, so beside one CPU-burning process two threads ran the trace slower than
one (docs/latency.md, eighth round). ``CpuShare`` looks at the busy time of the cores it may
use in ``/proc/stat`` minus this process's own CPU time (``os.times``: its threads' spinning counts
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

# Long enough for /proc/stat's 10 ms ticks to average (25 a core), short enough to follow a
# burner that starts or stops within a step or two of a decode.
WINDOW_S = 0.25


class Sample(NamedTuple):
    """Cumulative seconds at one moment: the busy time of the cores this process may use,
    its own CPU time, and the wall clock."""

    machine_busy_s: float
    own_s: float
    wall_s: float


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container may narrow)."""
    return len(_affinity()) or os.cpu_count() or 1


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set()


def busy_seconds(proc_stat: bytes, cpus: set[int], ticks_per_s: int) -> float | None:
    """The busy time of ``cpus`` in a ``/proc/stat`` text: user, nice, system, irq and softirq
    of their ``cpuN`` lines (idle, iowait and steal are no process holding a core). Only the
    cores this process may use count: in a container narrowed to 2 of a host's 64 cores the
    host's other 62 are not its business. None where no line of ``cpus`` parses."""
    busy, seen = 0, False
    for line in proc_stat.splitlines():
        fields = line.split()
        if len(fields) < 8 or not fields[0].startswith(b"cpu") or fields[0] == b"cpu":
            continue
        try:
            cpu = int(fields[0][3:])
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
        except ValueError:
            continue
        if cpu in cpus:
            busy, seen = busy + user + nice + system + irq + softirq, True
    return busy / ticks_per_s if seen else None


def read_sample() -> Sample | None:
    """Now: the busy time of this process's cores (``busy_seconds``), its own CPU time and the
    clock; None without ``/proc/stat`` (not Linux) or an affinity to read."""
    cpus = _affinity()
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    busy_s = busy_seconds(text, cpus, os.sysconf("SC_CLK_TCK")) if cpus else None
    if busy_s is None:
        return None
    times = os.times()
    return Sample(busy_s, times.user + times.system, time.monotonic())


def free_threads(before: Sample, now: Sample, cores: int, ceiling: int) -> int:
    """The threads to run after the window ``before`` -> ``now``: ``cores`` less the cores the
    other processes kept busy on average, rounded to the nearest, within [1, ``ceiling``]."""
    wall = now.wall_s - before.wall_s
    if wall <= 0:
        return ceiling
    others = (now.machine_busy_s - before.machine_busy_s) - (now.own_s - before.own_s)
    # Rounded: half a core of others' work takes a thread away (2 threads beside a burner:
    # others ~0.7 of a core, as each of the 3 runnable threads gets 2/3 of one).
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
