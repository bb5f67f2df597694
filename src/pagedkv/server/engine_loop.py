"""The engine loop: one background thread owns the (not thread-safe) ``LLMEngine``.

HTTP handlers never touch the engine. They put commands (submit, abort) in a thread-safe
mailbox (``server/mailbox.py``) and receive their requests' outputs through the ``deliver``
callables they hand in (the app's wrap ``loop.call_soon_threadsafe``). The thread applies every
queued command between two steps, so a request that arrives while others decode joins the
running batch at the next step.

Fair admission: one HTTP request may carry many prompts. They wait in the loop's own queue, and
the loop hands the engine only enough to keep a short queue ahead of the running batch
(``admit_ahead_seqs`` sequences), taking one prompt per HTTP request in turn. A small request
sent after a giant one therefore waits behind a few of its prompts, not all of them.

Failures: ``engine.step`` contains a failure it can trace (the request comes back finished with
``error`` set) and the loop answers that request alone with a 500. If a step still raises, the
requests inside the engine fail (aborted, so their blocks are freed) and the loop goes on; only
``max_step_failures`` failed steps in a row mark the engine failed (``/health`` 503); a
tensor-parallel rank's failure (``RankFailure``) marks it failed at once and calls ``on_fatal``.

After every iteration the thread publishes an immutable ``LoopSnapshot`` (the engine's own
``snapshot()`` plus the loop's counts): ``/metrics`` reads that, never the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.engine.stats import EngineSnapshot
from pagedkv.errors import RankFailure, UsageError
from pagedkv.server.delivery import Deliver, Delivery, Failure, Submission, failure_of
from pagedkv.server.engine_call import EngineCall
from pagedkv.server.fair_queue import FairQueue
from pagedkv.server.mailbox import STOP, Abort, Mailbox, Submit

__all__ = ["Deliver", "Delivery", "EngineLoop", "Failure", "LoopSnapshot", "Submission"]

log = logging.getLogger("pagedkv.server")

# Sequences kept queued in the engine ahead of its running batch: enough to refill the batch at
# every step, few enough that a request arriving later is not stuck behind a long queue.
ADMIT_AHEAD_SEQS = 16
# An idle loop wakes this often (seconds) to publish KV events it still owes (a snapshot
# after a Redis outage): cheap, and a router is never more than this behind an idle replica.
IDLE_WAKE_S = 1.0
# Steps that raise in a row before the engine is no longer trusted (one is a request's fault).
MAX_STEP_FAILURES = 3


@dataclass(frozen=True)
class LoopSnapshot:
    """The engine's snapshot plus what only the loop knows; immutable, any thread reads it."""

    engine: EngineSnapshot
    num_requests_in_flight: int  # engine requests submitted, not yet finished or aborted
    num_requests_queued: int  # of which still in the loop's fair queue (not in the engine)


class EngineLoop:
    """Owns ``engine`` once ``start`` is called; thread-safe ``submit``/``abort``/``stop``.

    Every submitted request gets, through its ``deliver``, zero or more ``RequestOutput``s and
    then exactly one final item: a finished ``RequestOutput`` or a ``Failure`` -- unless it is
    aborted first, after which it gets nothing more. ``deliver`` runs on the engine thread and
    must not block.
    """

    def __init__(
        self,
        engine: LLMEngine,
        admit_ahead_seqs: int = ADMIT_AHEAD_SEQS,
        max_step_failures: int = MAX_STEP_FAILURES,
    ) -> None:
        if admit_ahead_seqs < 1 or max_step_failures < 1:
            raise ValueError("admit_ahead_seqs and max_step_failures must be >= 1")
        self.engine = engine
        self._admit_ahead_seqs = admit_ahead_seqs
        self._max_step_failures = max_step_failures
        self._commands = Mailbox()  # closed by the engine thread when it ends
        # -- engine thread only --
        self._delivers: dict[str, Deliver] = {}  # requests inside the engine
        self._queued: FairQueue[Submission] = FairQueue()  # not yet in the engine
        self._step_failures = 0  # steps that raised in a row
        # --
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # set when the engine is no longer trusted
        self.on_fatal: Callable[[str], None] | None = None  # a rank failed: the server ends
        self.snapshot = LoopSnapshot(engine.snapshot(), 0, 0)

    # -- any thread ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail every request still in flight with 503 and end the thread. Idempotent."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(STOP)
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failed is None

    def submit_group(self, group: Sequence[Submission]) -> None:
        """Queue the engine requests of one HTTP request; they are admitted fairly."""
        if self._commands.offer(Submit(tuple(group))):
            return
        for sub in group:
            sub.deliver(Failure("the server is shutting down", 503, "shutting_down"))

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
        deliver: Deliver,
    ) -> None:
        self.submit_group([Submission(request_id, prompt_token_ids, params, cache_salt, deliver)])

    def abort(self, request_id: str) -> None:
        """Stop the request and free its blocks at the next command drain (before the next
        step); a no-op for a request that already finished."""
        self._commands.put(Abort(request_id))

    def call(self, call: EngineCall) -> None:
        """Run ``call`` on the engine thread between two steps (refused once stopped)."""
        if not self._commands.offer(call):
            call.refuse()

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._iterate():
                    return
            except Exception as exc:  # our own bug or the engine's: contained like a step
                self._step_raised(exc)
            self._publish()

    def _iterate(self) -> bool:
        """Apply the queued commands, admit fairly, run one step; True once stopped."""
        idle = self.failed is not None or not (self.engine.has_unfinished() or self._queued)
        commands = self._commands.drain(block=idle, timeout_s=IDLE_WAKE_S)
        if idle and not commands and self.failed is None:
            self.engine.publish_kv_events()  # a woken idle loop: what a router is still owed
        for k, command in enumerate(commands):
            if command is STOP:
                self._shut_down(commands[k + 1 :])
                return True
            self._apply(command)
        if self.failed is None:
            self._admit()
            if self.engine.has_unfinished():
                self._step()
        return False

    def _apply(self, command: Submit | Abort | EngineCall) -> None:
        """Run a call, abort a request, or queue a submission (answered at once if failed)."""
        if isinstance(command, EngineCall):
            return command.run(self.engine)
        if isinstance(command, Abort):
            if self._queued.remove(command.request_id):
                return
            if self._delivers.pop(command.request_id, None) is not None and self.failed is None:
                self.engine.abort(command.request_id)
            return
        if self.failed is not None:
            for sub in command.group:
                sub.deliver(Failure(f"the engine failed: {self.failed}", 503, "engine_failed"))
            return
        self._queued.add_group(command.group)

    def _admit(self) -> None:
        """Hand the engine queued requests, one per HTTP request in turn, until it has
        ``admit_ahead_seqs`` sequences waiting."""
        waiting = self.snapshot.engine.num_waiting_seqs  # as the last step left it
        while waiting < self._admit_ahead_seqs and (sub := self._queued.pop()) is not None:
            if self._add(sub):
                waiting += sub.params.n

    def _add(self, sub: Submission) -> bool:
        try:
            self.engine.add_request(
                list(sub.prompt_token_ids),
                sub.params,
                request_id=sub.request_id,
                cache_salt=sub.cache_salt,
            )
        except UsageError as exc:
            sub.deliver(Failure(str(exc), 400, exc.code, exc.param))
            return False
        except Exception as exc:  # noqa: BLE001 - an engine bug: this request fails, not the loop
            log.exception("adding %s failed", sub.request_id)
            sub.deliver(
                Failure(f"the engine could not add the request: {exc!r}", 500, "engine_error")
            )
            return False
        self._delivers[sub.request_id] = sub.deliver
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - contained below, the loop goes on
            self._step_raised(exc)
            return
        self._step_failures = 0
        for out in outputs:
            deliver = self._delivers.get(out.request_id)
            if deliver is None:
                continue  # aborted by its client in the meantime
            if out.finished:
                del self._delivers[out.request_id]
            deliver(failure_of(out) or out)

    def _step_raised(self, exc: Exception) -> None:
        """Fail the requests inside the engine (their blocks are freed) and go on; after
        ``max_step_failures`` in a row the engine is marked failed."""
        self._step_failures += 1
        fatal = isinstance(exc, RankFailure)
        if self._step_failures >= self._max_step_failures or self.failed is not None or fatal:
            log.error(
                "the engine loop failed %d times in a row; failing every request",
                self._step_failures,
                exc_info=None if fatal else exc,  # a rank's failure is its own one line
            )
            self.failed = f"{type(exc).__name__}: {exc}"
            self._fail_all(f"the engine failed: {self.failed}", 500, "engine_failed")
            if fatal and self.on_fatal is not None:
                self.on_fatal(str(exc))
            return
        log.error("an engine step failed; failing the requests inside the engine", exc_info=exc)
        self._fail_in_engine(
            f"the request failed inside the engine: {type(exc).__name__}: {exc}",
            500,
            "engine_error",
        )

    def _shut_down(self, pending: list[Any]) -> None:
        self._commands.close()  # no submit can queue behind us from now on
        self._fail_all("the server is shutting down", 503, "shutting_down")
        for command in pending + self._commands.drain(block=False, timeout_s=0):
            if isinstance(command, EngineCall):
                command.refuse()
            elif isinstance(command, Submit):
                for sub in command.group:
                    sub.deliver(Failure("the server is shutting down", 503, "shutting_down"))

    def _fail_in_engine(self, message: str, status_code: int, code: str) -> None:
        delivers, self._delivers = self._delivers, {}
        for request_id, deliver in delivers.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the request is failed whatever the engine says
                log.exception("aborting %s after a failed step", request_id)
            deliver(Failure(message, status_code, code))

    def _fail_all(self, message: str, status_code: int, code: str) -> None:
        self._fail_in_engine(message, status_code, code)
        for sub in self._queued.drain():
            sub.deliver(Failure(message, status_code, code))

    def _publish(self) -> None:
        try:
            engine = self.engine.snapshot()
        except Exception:  # noqa: BLE001 - a broken engine keeps its last known state
            log.exception("the engine snapshot failed")
            engine = self.snapshot.engine
        in_flight = len(self._delivers) + len(self._queued)
        self.snapshot = LoopSnapshot(engine, in_flight, len(self._queued))
