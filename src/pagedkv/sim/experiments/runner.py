"""``run_points``: evaluate independent sweep points on every core, results in input order."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TypeVar

P = TypeVar("P")
R = TypeVar("R")


def default_workers() -> int:
    """The cores this process may use (the affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_points(
    fn: Callable[[P], R],
    points: Sequence[P],
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[R]:
    """``[fn(p) for p in points]``, computed in ``workers`` processes (default: every core;
    1 runs in this process, which tests and debuggers prefer). ``fn`` must be a module-level
    function and the points picklable. ``progress(done, total)`` is called in this process
    after each point. An exception in a point is raised here, after the pool shuts down."""
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total = len(points)
    if workers == 1 or total <= 1:
        results = []
        for i, point in enumerate(points):
            results.append(fn(point))
            if progress is not None:
                progress(i + 1, total)
        return results
    out: list[R | None] = [None] * total
    with ProcessPoolExecutor(max_workers=min(workers, total)) as pool:
        futures = {pool.submit(fn, p): i for i, p in enumerate(points)}
        for done, future in enumerate(as_completed(futures), start=1):
            out[futures[future]] = future.result()
            if progress is not None:
                progress(done, total)
    return out  # type: ignore[return-value]
