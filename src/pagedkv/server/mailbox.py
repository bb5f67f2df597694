"""The engine loop's mailbox: the commands any thread queues for the engine thread.

A handler submits requests, aborts them or asks for an ``EngineCall``; the engine thread drains
them all between two steps. Once the loop stops, the mailbox is closed: new work is refused at
the door (the caller answers it), while an abort or the stop itself may still be queued and is
simply never acted on.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

from pagedkv.server.delivery import Submission


@dataclass(frozen=True)
class Submit:
    """The engine requests of one HTTP request, admitted fairly."""

    group: tuple[Submission, ...]


@dataclass(frozen=True)
class Abort:
    """Stop a request and free its blocks."""

    request_id: str


STOP = object()  # the loop's last command: fail what is in flight and end the thread


class Mailbox:
    """Thread-safe: ``offer`` and ``put`` from any thread, ``drain`` on the engine thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False  # set by the engine thread when it ends; guarded by _lock
        self._lock = threading.Lock()

    def offer(self, command: Any) -> bool:
        """Queue new work; False (nothing queued) once the mailbox is closed."""
        with self._lock:
            if self._closed:
                return False
            self._queue.put(command)
            return True

    def put(self, command: Any) -> None:
        """Queue a command that is harmless after the close (an abort, the stop)."""
        self._queue.put(command)

    def close(self) -> None:
        """Refuse every later ``offer``: no new work can queue behind the caller's drain."""
        with self._lock:
            self._closed = True

    def qsize(self) -> int:
        """Commands queued and not yet drained (approximate while other threads queue)."""
        return self._queue.qsize()

    def drain(self, block: bool, timeout_s: float) -> list[Any]:
        """The queued commands; with ``block``, waits for one, at most ``timeout_s``."""
        commands = []
        if block:
            try:
                commands.append(self._queue.get(timeout=timeout_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._queue.get_nowait())
            except queue.Empty:
                return commands
