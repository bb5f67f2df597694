"""``run_points``: results in input order whatever the worker count; errors reach the caller."""

from __future__ import annotations

import pytest

from pagedkv.sim.experiments.runner import run_points


def _square_or_fail(x: int) -> int:
    if x < 0:
        raise ValueError(f"negative point {x}")
    return x * x


@pytest.mark.parametrize("workers", [1, 2])
def test_results_follow_the_points_and_progress_counts_each(workers: int) -> None:
    seen: list[tuple[int, int]] = []
    points = [5, 3, 8, 1, 0, 7]
    out = run_points(_square_or_fail, points, workers, lambda d, t: seen.append((d, t)))
    assert out == [25, 9, 64, 1, 0, 49]
    assert [d for d, _ in seen] == list(range(1, 7)) and {t for _, t in seen} == {6}


def test_a_failing_point_raises_in_the_caller() -> None:
    with pytest.raises(ValueError, match="negative point -2"):
        run_points(_square_or_fail, [1, -2, 3], workers=2)


def test_zero_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="workers"):
        run_points(_square_or_fail, [1], workers=0)
