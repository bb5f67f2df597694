"""Progress on stderr for the commands that run for minutes (`demo`, a batch of `generate`
prompts, `profile`): a slow machine otherwise prints nothing until the end. stdout, what
scripts read, is never touched.

A line per finished item, at most one every ``EVERY_S`` (the last always), so a log stays
short and a terminal shows it moving: ``pagedkv generate: 3/8 prompts done, 412 tokens, 38.1
tok/s``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

EVERY_S = 2.0  # seconds between two progress lines at most one


class ProgressLines:
    """Counts finished items (and tokens, when given) out of ``total``; ``advance`` prints
    ``label: n/total unit done[, detail]`` to ``stream`` when due. ``clock`` is injectable so
    that tests decide when a line is due."""

    def __init__(
        self,
        total: int,
        label: str,
        unit: str,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = EVERY_S,
    ) -> None:
        self.total, self.label, self.unit = total, label, unit
        self.num_done = 0
        self._stream = stream
        self._clock, self._every_s = clock, every_s
        self._start_s = clock()
        self._last_line_s: float | None = None

    def elapsed_s(self) -> float:
        return self._clock() - self._start_s

    def advance(self, num_done: int = 1, detail: str = "", quiet: bool = False) -> None:
        """``num_done`` more items finished; a line unless ``quiet`` or one was printed less
        than ``every_s`` ago (the line of the last item is never skipped unless ``quiet``)."""
        self.num_done += num_done
        now = self._clock()
        last = self.num_done >= self.total
        due = self._last_line_s is None or now - self._last_line_s >= self._every_s
        if num_done and not quiet and (due or last):
            self._last_line_s = now
            line = f"{self.label}: {self.num_done}/{self.total} {self.unit} done"
            print(
                f"{line}, {detail}" if detail else line, file=self._stream or sys.stderr, flush=True
            )


class BatchProgress:
    """``ProgressLines`` over an engine's step outputs: finished requests and the tokens
    generated so far (every sample of every request, finished or not)."""

    def __init__(self, total: int, label: str, unit: str = "prompts", **kwargs) -> None:
        self.lines = ProgressLines(total, label, unit, **kwargs)
        self._tokens: dict[str, int] = {}  # request id -> tokens generated so far

    def update(self, outputs: Iterable, quiet: bool = False) -> None:
        """After one ``engine.step()``: note its outputs (``RequestOutput``s)."""
        finished = 0
        for out in outputs:
            self._tokens[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
            finished += out.finished
        tokens = sum(self._tokens.values())
        elapsed_s = self.lines.elapsed_s()
        rate = f", {tokens / elapsed_s:.1f} tok/s" if elapsed_s > 0 else ""
        self.lines.advance(finished, f"{tokens} tokens{rate}", quiet)


def run_batch(engine, prompts: Sequence[list[int]], params, label: str) -> list:
    """Run every prompt (token ids ``engine.check_request`` accepted) to the end as one
    continuous batch: the outputs in prompt order, progress lines on stderr meanwhile."""
    request_ids = [engine.add_request(ids, params) for ids in prompts]
    progress = BatchProgress(len(request_ids), label)
    finished: dict[str, object] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        progress.update(outputs)
        finished.update((out.request_id, out) for out in outputs if out.finished)
    return [finished[r] for r in request_ids]
