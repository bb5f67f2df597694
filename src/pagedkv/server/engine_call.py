"""``EngineCall``: a function of the engine run on the engine loop's thread, the one thread that
may read the engine's allocator (``EngineLoop.call``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class EngineCall:
    """``fn(engine)``; ``future`` holds its result or its exception. ``fn`` must be quick (the
    next step waits for it) and read-only (the loop's requests are not its to change)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.future: Future = Future()

    def run(self, engine: Any) -> None:
        try:
            self.future.set_result(self.fn(engine))
        except Exception as exc:  # noqa: BLE001 - the caller's to judge, never the loop's
            self.future.set_exception(exc)

    def refuse(self) -> None:
        """The loop is stopped: the call never runs."""
        self.future.set_exception(RuntimeError("the engine loop is stopped"))
