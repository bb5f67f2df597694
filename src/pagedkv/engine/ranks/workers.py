"""Rank 0's handle on its workers (ranks 1..N-1): start them, send each step, watch them, stop.

Faults end the engine, never hang it: a worker that raises reports its error (``Failed``) and
exits; one that dies is seen by the watchdog thread (its process sentinel) within a poll, and
by rank 0's next collective at once (gloo sees the closed connection). Either way the other
workers are stopped, ``failure`` says which rank and why, and every later ``send`` raises
``RankFailure`` with that line. ``stop`` (the engine's ``close``, at exit too) sends ``STOP``,
then terminates and kills what has not ended within its grace.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from pagedkv.engine.ranks.messages import (
    STOP,
    Failed,
    LogitsOrder,
    Reply,
    StepMessage,
    WorkerSpec,
)
from pagedkv.engine.runner import StepInputs
from pagedkv.errors import RankFailure
from pagedkv.kvcache.tiers.contract import TIER_HOST
from pagedkv.kvcache.tiers.host_index import HostTierIndex
from pagedkv.sched.batch import ScheduledBatch

# How long rank 0 waits for a worker's own account of a failure its collective saw.
VERDICT_WAIT_S = 3.0
STOP_GRACE_S = 5.0


class Workers:
    """Ranks 1..N-1 as processes, one duplex pipe each. Thread-safe: ``failure`` and ``stop``
    may be read or called from any thread; ``send`` and ``replies`` from the engine's."""

    def __init__(self, procs: list, conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.failure: str | None = None
        self.host_index: HostTierIndex | None = None  # rank 0's host tier, where there is one
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="pagedkv-ranks", daemon=True)
        self._watchdog.start()
        atexit.register(self.stop)

    @classmethod
    def start(cls, specs: list[WorkerSpec]) -> Workers:
        """Spawn one process per spec (ranks 1..N-1); returns at once (they load meanwhile)."""
        from pagedkv.engine.ranks.worker import worker_main

        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for spec in specs:
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                args=(spec, theirs),
                name=f"pagedkv-rank{spec.rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        return cls(procs, conns)

    def send(self, message: object) -> None:
        """``message`` to every worker (pickled once). ``RankFailure`` once one has failed."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        raw = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(raw)
            except OSError as exc:  # a broken pipe: the worker is gone
                raise self.failure_of(exc) from None

    def send_step(self, batch: ScheduledBatch, inputs: StepInputs | None) -> None:
        """The step to every worker (``runner.RankLink``), with the host slots of the hashes
        its orders move to or from the host tier."""
        keys = [h for _, h in batch.block_offloads]
        keys += [load.block_hash for load in batch.block_loads if load.tier == TIER_HOST]
        index = self.host_index
        slots = {h: index.slot_of(h) for h in keys} if index is not None and keys else {}
        self.send(StepMessage.of(batch, inputs, slots))

    def send_logits(self, rows: int) -> None:
        self.send(LogitsOrder(rows))

    def replies(self, what: str, timeout_s: float) -> list[Reply]:
        """Each worker's ``Reply`` of ``what``, in rank order; ``RankFailure`` when one fails,
        dies or does not answer within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        out = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            while not conn.poll(0.2):
                if self.failure is not None or not proc.is_alive():
                    raise self.failure_of(None)
                if time.monotonic() > deadline:
                    self._fail(f"rank {rank} did not answer {what!r} within {timeout_s:g} s")
                    raise RankFailure(self.failure)
            reply = self._read(conn)
            if isinstance(reply, Failed):
                self._fail(_describe_failed(reply))
                raise RankFailure(self.failure)
            if not isinstance(reply, Reply) or reply.what != what:
                self._fail(f"rank {rank} answered {reply!r}, not {what!r}")
                raise RankFailure(self.failure)
            out.append(reply)
        return out

    def failure_of(self, exc: BaseException | None) -> RankFailure:
        """The ``RankFailure`` to raise where rank 0's collective (or pipe) failed with
        ``exc``: the failed worker's own account when it gives one within
        ``VERDICT_WAIT_S``, else what rank 0 saw. Every worker is stopped."""
        deadline = time.monotonic() + VERDICT_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            if not all(p.is_alive() for p in self.procs):
                self._check_exits()
            else:
                time.sleep(0.05)
        if self.failure is None:
            seen = "" if exc is None else f": {type(exc).__name__}: {str(exc)[:300]}"
            self._fail(f"rank 0's collective with the other ranks failed{seen}")
        return RankFailure(self.failure)

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """Stop every worker (idempotent): ``STOP``, then terminate, then kill."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        raw = pickle.dumps(STOP)
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that worker is gone already
                conn.send_bytes(raw)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        atexit.unregister(self.stop)

    # -- the watchdog ----------------------------------------------------------------------

    def _watch(self) -> None:
        """Wake when a worker's process ends; an end before ``stop`` is a failure."""
        pending = {p.sentinel: p for p in self.procs}
        while pending and not self._stopping.is_set():
            for sentinel in wait(list(pending), timeout=0.5):
                # The sentinel's pipe closes a moment before the process can be reaped.
                pending.pop(sentinel).join(1.0)  # type: ignore[call-overload]
                if not self._stopping.is_set():
                    self._check_exits()

    def _check_exits(self) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            if proc.is_alive() or self.failure is not None:
                continue
            message = self._read(conn) if _readable(conn) else None
            if isinstance(message, Failed):
                self._fail(_describe_failed(message))
            else:
                self._fail(f"rank {rank} (pid {proc.pid}) {_exit_words(proc.exitcode)}")

    def _fail(self, why: str) -> None:
        """Record the first failure and stop the other workers (they would wait forever)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"tensor-parallel {why}; every rank is stopped"
        threading.Thread(target=self.stop, name="pagedkv-ranks-stop", daemon=True).start()

    def _read(self, conn: Connection) -> object:
        with self._lock:
            try:
                return pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return None


def _readable(conn: Connection) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return False


def _describe_failed(message: Failed) -> str:
    return f"rank {message.rank} failed: {message.error}"


def _exit_words(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
