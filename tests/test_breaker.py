"""The shared circuit breaker against hand-computed sequences, on a fake clock (no sleeps)."""

from __future__ import annotations

import pytest

from pagedkv.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pagedkv.errors import UsageError


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(**kwargs) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    kwargs.setdefault("failure_threshold", 3)
    kwargs.setdefault("backoff_s", 2.0)
    kwargs.setdefault("max_backoff_s", 10.0)
    return CircuitBreaker(clock=clock, **kwargs), clock


def fail(b: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        assert b.allow()
        b.record_failure()


def test_opens_after_n_consecutive_failures_and_short_circuits():
    b, clock = make()
    fail(b, 2)
    assert b.state == CLOSED
    fail(b, 1)  # the third consecutive failure
    assert b.state == OPEN and b.num_opens == 1
    assert [b.allow() for _ in range(5)] == [False] * 5
    assert b.num_short_circuits == 5 and b.num_failures == 3
    assert b.retry_in_s() == 2.0
    clock.now_s += 1.5
    assert not b.allow() and b.retry_in_s() == 0.5


def test_a_success_resets_the_consecutive_count():
    b, _ = make()
    fail(b, 2)
    assert b.allow()
    b.record_success()
    fail(b, 2)  # 2 + success + 2: never 3 in a row
    assert b.state == CLOSED and b.num_opens == 0 and b.num_failures == 4


def test_half_open_lets_one_probe_and_its_success_closes():
    b, clock = make()
    fail(b, 3)
    clock.now_s += 2.0  # exactly the back-off
    assert b.state == HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow() and not b.allow()  # others wait for its verdict
    b.record_success()
    assert b.state == CLOSED and b.num_probes == 1 and b.num_short_circuits == 2
    assert all(b.allow() for _ in range(4))


def test_failed_probes_double_the_backoff_up_to_the_cap():
    """Hand-computed: opens at t=100 for 2 s; probes fail at 102 (4 s), 106 (8 s), 114 (10 s,
    capped), 124 (10 s); the probe at 134 succeeds and the next opening is 2 s again."""
    b, clock = make()
    fail(b, 3)
    opened_for = []
    for _ in range(4):
        clock.now_s += b.retry_in_s()
        assert b.allow()
        b.record_failure()
        opened_for.append(b.retry_in_s())
    assert opened_for == [4.0, 8.0, 10.0, 10.0]
    assert clock.now_s == 124.0 and b.num_opens == 5
    clock.now_s += 10.0
    assert b.allow()
    b.record_success()
    fail(b, 3)
    assert b.retry_in_s() == 2.0 and b.counts().backoff_s == 2.0


def test_a_cancelled_probe_frees_the_slot():
    b, clock = make()
    fail(b, 3)
    clock.now_s += 2.0
    assert b.allow()
    assert not b.allow()
    b.release()  # the probe's caller was cancelled: no verdict
    assert b.state == HALF_OPEN
    assert b.allow()  # the next caller probes at once


def test_a_probe_that_never_reports_is_presumed_lost():
    b, clock = make(probe_timeout_s=5.0)
    fail(b, 3)
    clock.now_s += 2.0
    assert b.allow()
    clock.now_s += 4.9
    assert not b.allow()
    clock.now_s += 0.1
    assert b.allow() and b.num_probes == 2


def test_late_outcomes_of_calls_already_in_flight():
    b, clock = make()
    for _ in range(4):  # four concurrent calls let through while closed
        assert b.allow()
    for _ in range(3):
        b.record_failure()
    assert b.state == OPEN
    b.record_failure()  # the fourth's failure, already open: counted, nothing else
    assert b.num_opens == 1 and b.num_failures == 4 and b.retry_in_s() == 2.0
    b.record_success()  # a late success proves the peer answers
    assert b.state == CLOSED


def test_counts_snapshot():
    b, clock = make(failure_threshold=1)
    fail(b, 1)
    assert not b.allow()
    c = b.counts()
    assert (c.state, c.num_failures, c.num_opens, c.num_short_circuits, c.num_probes) == (
        OPEN, 1, 1, 1, 0)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"failure_threshold": 0}, "failure_threshold"),
     ({"failure_threshold": 2.5}, "failure_threshold"),
     ({"failure_threshold": True}, "failure_threshold"),
     ({"backoff_s": 0.0}, "backoff_s"),
     ({"backoff_s": float("nan")}, "backoff_s"),
     ({"backoff_s": float("inf")}, "backoff_s"),
     ({"backoff_s": 5.0, "max_backoff_s": 1.0}, "max_backoff_s"),
     ({"probe_timeout_s": -1.0}, "probe_timeout_s")],
)  # fmt: skip
def test_bad_arguments_are_usage_errors(kwargs, field):
    with pytest.raises(UsageError) as err:
        CircuitBreaker(**kwargs)
    assert err.value.param == field
