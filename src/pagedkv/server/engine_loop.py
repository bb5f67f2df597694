"""The engine loop: one background thread owns the (not thread-safe) ``LLMEngine``.

HTTP handlers never touch the engine. They put commands (add, abort) on a thread-safe queue and
receive their request's outputs through a ``deliver`` callable they hand in with the request
(the app's wraps ``loop.call_soon_threadsafe``). The thread applies every queued command between
two steps, so a request that arrives while others decode joins the running batch at the next
step: continuous batching. When nothing is queued or running the thread sleeps on the queue.

After every step the thread publishes an immutable ``EngineSnapshot`` (pool, queues, counters):
``/metrics`` and ``/health`` read that, never the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine import LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger("pagedkv.server")


@dataclass(frozen=True)
class Failure:
    """Why a request ended without (more) output. ``status_code`` is the HTTP status a handler
    answers with if nothing was sent yet: 400 the engine refused the input, 503 shutting down,
    500 the engine failed."""

    message: str
    status_code: int
    code: str


# What ``deliver`` receives: a snapshot of the request (kept by the receiver) or a Failure.
Delivery = RequestOutput | Failure
Deliver = Callable[[Delivery], None]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after one step; every field counts blocks, sequences or tokens."""

    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    kv_utilization: float  # used slots / pool slots
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_running_seqs: int
    num_waiting_seqs: int
    peak_running_seqs: int  # most sequences in one step's batch since start
    num_preemptions: int
    generated_tokens: int
    num_steps: int
    num_requests_in_flight: int  # submitted, not yet finished or aborted


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str | None
    deliver: Deliver


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class EngineLoop:
    """Owns ``engine`` once ``start`` is called; thread-safe ``submit``/``abort``/``stop``.

    Every submitted request gets, through its ``deliver``, zero or more ``RequestOutput``s and
    then exactly one final item: a finished ``RequestOutput`` or a ``Failure`` -- unless it is
    aborted first, after which it gets nothing more. ``deliver`` runs on the engine thread and
    must not block.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._delivers: dict[str, Deliver] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.failed: str | None = None  # set when a step raised: the engine is not trusted
        self._stopped = False  # set by the engine thread when it ends; guarded by _lock
        self._lock = threading.Lock()
        self.snapshot = self._take_snapshot()

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
        self._commands.put(_STOP)
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failed is None

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
        deliver: Deliver,
    ) -> None:
        with self._lock:
            if not self._stopped:
                self._commands.put(_Add(request_id, prompt_token_ids, params, cache_salt, deliver))
                return
        deliver(Failure("the server is shutting down", 503, "shutting_down"))

    def abort(self, request_id: str) -> None:
        """Stop the request and free its blocks at the next command drain (before the next
        step); a no-op for a request that already finished."""
        self._commands.put(_Abort(request_id))

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._iterate():
                    return
                self.snapshot = self._take_snapshot()
            except Exception as exc:  # engine (or our) bug: fail every request, never hang one
                self._mark_failed(exc)

    def _iterate(self) -> bool:
        """Apply the queued commands, then run one step; True once stopped."""
        idle = not self.engine.has_unfinished() or self.failed is not None
        commands = self._drain(block=idle)
        for k, command in enumerate(commands):
            if command is _STOP:
                self._shut_down(commands[k + 1 :])
                return True
            self._apply(command)
        if self.failed is None and self.engine.has_unfinished():
            self._step()
        return False

    def _mark_failed(self, exc: Exception) -> None:
        log.error("the engine loop failed; failing every request", exc_info=exc)
        self.failed = f"{type(exc).__name__}: {exc}"
        self._fail_all(f"the engine failed: {self.failed}", 500, "engine_failed")

    def _shut_down(self, pending: list[Any]) -> None:
        with self._lock:  # no submit can queue behind us from now on
            self._stopped = True
        self._fail_all("the server is shutting down", 503, "shutting_down")
        for command in pending + self._drain(block=False):
            if isinstance(command, _Add):
                command.deliver(Failure("the server is shutting down", 503, "shutting_down"))
        self.snapshot = self._take_snapshot()

    def _drain(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._delivers.pop(command.request_id, None) is not None and self.failed is None:
                self.engine.abort(command.request_id)
            return
        if self.failed is not None:
            command.deliver(Failure(f"the engine failed: {self.failed}", 503, "engine_failed"))
            return
        try:
            self.engine.add_request(
                list(command.prompt_token_ids),
                command.params,
                request_id=command.request_id,
                cache_salt=command.cache_salt,
            )
        except ValueError as exc:
            command.deliver(Failure(str(exc), 400, "invalid_request"))
            return
        self._delivers[command.request_id] = command.deliver

    def _step(self) -> None:
        outputs = self.engine.step()  # raising: _run marks the engine failed
        for out in outputs:
            deliver = self._delivers.get(out.request_id)
            if deliver is None:
                continue  # aborted by its client in the meantime
            if out.finished:
                del self._delivers[out.request_id]
            deliver(out)

    def _fail_all(self, message: str, status_code: int, code: str) -> None:
        delivers, self._delivers = self._delivers, {}
        for request_id, deliver in delivers.items():
            if self.failed is None:
                self.engine.abort(request_id)
            deliver(Failure(message, status_code, code))

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        kv = engine.allocator.stats()
        recorder = engine.recorder
        return EngineSnapshot(
            num_total_blocks=kv.num_total_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            kv_utilization=kv.kv_utilization,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            prefix_query_tokens=kv.prefix_query_tokens,
            num_running_seqs=engine.scheduler.num_running,
            num_waiting_seqs=engine.scheduler.num_waiting,
            peak_running_seqs=recorder.peak_running,
            num_preemptions=engine.scheduler.num_preemptions,
            generated_tokens=recorder.generated_tokens,
            num_steps=recorder.num_steps,
            num_requests_in_flight=len(self._delivers),
        )
