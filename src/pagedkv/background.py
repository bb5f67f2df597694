"""``QueueThread``: the life of a daemon thread that sends, in order, what other threads queue
(the KV store's write-through, the KV event publisher). The step's thread only appends; the
network is this thread's. A process that exits normally sends what it queued (``atexit``)."""

from __future__ import annotations

import atexit
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Any


class QueueThread(ABC):
    """Subclasses append to ``_queue`` and take from it under ``_cond``, count what they took
    and have not settled yet in ``_in_flight`` (``notify_all`` when settled), implement
    ``_run`` (return once ``_closed`` and the queue is empty) and ``_after_close``, and call
    ``_start()`` at the end of their ``__init__``. ``flush`` and ``close`` are safe from any
    thread."""

    def __init__(self, thread_name: str) -> None:
        self._queue: deque[Any] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        self._thread.start()
        atexit.register(self.close)

    @abstractmethod
    def _run(self) -> None:
        """The thread's loop: send queued items in order; return once closed and drained."""

    @abstractmethod
    def _after_close(self) -> None:
        """Release what the thread used (a connection); called once it stopped."""

    @property
    def num_queued(self) -> int:
        """Items queued and not yet taken by the thread (a snapshot: it may change at once)."""
        with self._cond:
            return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        """Items the thread took and has not settled yet (a snapshot, like ``num_queued``)."""
        with self._cond:
            return self._in_flight

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far was sent or dropped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the thread."""
        atexit.unregister(self.close)
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._after_close()
