"""One circuit breaker for every sick peer: stop calling a peer that keeps failing, probe it
after a back-off, resume when it answers.

States (``CircuitBreaker.state``):

* ``closed``: every call goes through. ``failure_threshold`` consecutive failures (a timeout,
  a refused connection and a bad answer are all failures) open the breaker; a success resets
  the count.
* ``open``: no call goes through (``allow()`` is False, counted as short-circuited) until the
  back-off has passed; the caller does its fallback at once (computes locally, picks another
  peer) instead of waiting for the peer.
* ``half_open``: the back-off has passed; the next ``allow()`` is the one probe, every other
  caller is short-circuited while it is in flight. The probe's success closes the breaker
  (back-off back to ``backoff_s``); its failure opens it again for twice the last back-off,
  at most ``max_backoff_s``.

How a caller uses it (the P/D prefill client ``disagg/prefill_client.py`` does exactly this;
a router would keep one breaker per replica)::

    if not breaker.allow():
        return fallback()                    # short-circuited: the peer is not asked
    try:
        answer = await call_peer()
    except PeerError:                        # timeout, refused connection, bad answer
        breaker.record_failure()
        return fallback()
    except BaseException:                    # cancelled: no verdict on the peer
        breaker.release()
        raise
    breaker.record_success()

Every allowed call must end in exactly one of ``record_success``, ``record_failure`` or
``release``. A probe that never reports (a bug in the caller) is presumed lost after
``probe_timeout_s`` (when given), so a breaker can never stay half-open for good.

Outcomes of calls that were already in flight when the state changed count as well: a
success closes the breaker from any state (the peer answered), a failure in ``open`` only
adds to ``num_failures``. Calls that arrive together while ``closed`` all go through, so with
C concurrent callers up to ``failure_threshold + C - 1`` of them may wait for a sick peer
before it opens.

The clock (``time.monotonic`` unless given) is only read, never slept on: tests pass a fake
one. Thread-safe (one lock); nothing here blocks or does I/O. Torch-free and dependency-free.
Counters for ``/metrics`` (monotonic): ``num_successes``, ``num_failures``, ``num_opens``,
``num_probes``, ``num_short_circuits``; ``counts()`` takes them all at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.errors import UsageError

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATES = (CLOSED, HALF_OPEN, OPEN)


@dataclass(frozen=True)
class BreakerCounts:
    """One consistent snapshot of a breaker for ``/metrics``."""

    state: str
    num_successes: int
    num_failures: int
    num_opens: int
    num_probes: int
    num_short_circuits: int
    backoff_s: float  # the back-off of the current (or next) open period


class CircuitBreaker:
    """See the module docstring. ``failure_threshold`` >= 1 consecutive failures open it;
    ``backoff_s`` > 0 is the first open period, doubled after each failed probe up to
    ``max_backoff_s`` (default and minimum: ``backoff_s``). ``UsageError`` names the bad
    argument (``field`` is its name) for values out of range."""

    def __init__(
        self,
        failure_threshold: int = 3,
        backoff_s: float = 5.0,
        max_backoff_s: float | None = None,
        probe_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        max_backoff_s = backoff_s if max_backoff_s is None else max_backoff_s
        if (
            isinstance(failure_threshold, bool)
            or not isinstance(failure_threshold, int)
            or failure_threshold < 1
        ):
            raise UsageError(
                f"failure_threshold must be an integer >= 1, got {failure_threshold!r}",
                "failure_threshold",
            )
        for name, value in (
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
            ("probe_timeout_s", probe_timeout_s),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UsageError(f"{name} must be a finite number > 0, got {value!r}", name)
        if max_backoff_s < backoff_s:
            raise UsageError(
                f"max_backoff_s ({max_backoff_s:g}) must be >= backoff_s ({backoff_s:g})",
                "max_backoff_s",
            )
        self.failure_threshold = failure_threshold
        self.base_backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive_failures = 0
        self._backoff_s = self.base_backoff_s
        self._open_until_s = 0.0
        self._probe_started_s: float | None = None  # a probe in flight (half-open only)
        self.num_successes = 0
        self.num_failures = 0
        self.num_opens = 0
        self.num_probes = 0
        self.num_short_circuits = 0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open``, as the next ``allow()`` would see it (an
        open breaker whose back-off has passed reads ``half_open``)."""
        with self._lock:
            if self._state == OPEN and self._clock() >= self._open_until_s:
                return HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """True: make the call (and report its outcome). False: do not call the peer (counted
        in ``num_short_circuits``)."""
        with self._lock:
            now = self._clock()
            if self._state == CLOSED:
                return True
            if self._state == OPEN and now >= self._open_until_s:
                self._state = HALF_OPEN
            if self._state == HALF_OPEN and not self._probe_in_flight(now):
                self._probe_started_s = now
                self.num_probes += 1
                return True
            self.num_short_circuits += 1
            return False

    def record_success(self) -> None:
        """The peer answered: closed, with the failure count and the back-off reset."""
        with self._lock:
            self.num_successes += 1
            self._state = CLOSED
            self._consecutive_failures = 0
            self._backoff_s = self.base_backoff_s
            self._probe_started_s = None

    def record_failure(self) -> None:
        """The call failed or timed out: counts toward opening (closed), or opens again with a
        doubled back-off (a failed probe)."""
        with self._lock:
            self.num_failures += 1
            if self._state == CLOSED:
                self._consecutive_failures += 1
                if self._consecutive_failures >= self.failure_threshold:
                    self._open(self._backoff_s)
            elif self._state == HALF_OPEN:
                self._open(min(self._backoff_s * 2, self.max_backoff_s))

    def release(self) -> None:
        """An allowed call ended without a verdict on the peer (the caller was cancelled):
        a probe in flight is given up, so the next ``allow()`` may probe at once."""
        with self._lock:
            if self._state == HALF_OPEN:
                self._probe_started_s = None

    def retry_in_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        with self._lock:
            if self._state != OPEN:
                return 0.0
            return max(0.0, self._open_until_s - self._clock())

    def counts(self) -> BreakerCounts:
        state = self.state
        with self._lock:
            return BreakerCounts(
                state,
                self.num_successes,
                self.num_failures,
                self.num_opens,
                self.num_probes,
                self.num_short_circuits,
                self._backoff_s,
            )

    def _open(self, backoff_s: float) -> None:
        self._state = OPEN
        self._backoff_s = backoff_s
        self._open_until_s = self._clock() + backoff_s
        self._probe_started_s = None
        self._consecutive_failures = 0
        self.num_opens += 1

    def _probe_in_flight(self, now: float) -> bool:
        if self._probe_started_s is None:
            return False
        # A probe silent for longer than probe_timeout_s is presumed lost (its caller never
        # reported), so the breaker cannot stay half-open for good.
        timeout_s = self.probe_timeout_s
        return timeout_s is None or now - self._probe_started_s < timeout_s
