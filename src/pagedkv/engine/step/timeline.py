"""``StepTimeline``: where one engine step's time goes, phase by phase.

The engine (``LLMEngine.step``) and its runner mark the end of each phase of a step when a
timeline is attached (``engine.timeline``; None, the default, costs one ``is None`` test a
phase). The host phases are wall-clock spans that tile the step end to end, so they add up to
the step's wall time exactly:

=================  ========================================================================
``schedule``       the scheduler picks the batch (admission, allocation, preemption)
``prepare``        the runner builds the step's metadata (ids, positions, slots, tables)
``kv_copies``      swap, copy-on-write, lower-tier loads before the forward
``forward``        the forward pass as the host sees it: launches on a GPU (the kernels run
                   on), the whole computation on the CPU
``kv_saves``       write-through saves after the forward; the logits' gather
``sample``         logits processing, grammar masks, the draw, the copy of the sampled ids to
                   the host: on a GPU the host waits here for the forward to finish
``record``         detokenizing, stop strings, logprobs into each request
``update``         the scheduler's update (finished, forked, freed) and the step's stats
=================  ========================================================================

On a GPU the forward's own time is measured too, with CUDA events around it (``gpu_forward``):
the span from its first launch to its last kernel's end. What the host does while the GPU
runs is the overlap: ``overlap = min(gpu_forward, host time from the forward's launch to the
wait in sample)``; a step whose host work is hidden has ``sample`` near ``gpu_forward -
forward``. ``TimedPhases`` is one step's record.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PHASES = ("schedule", "prepare", "kv_copies", "forward", "kv_saves", "sample", "record", "update")


@dataclass
class TimedPhases:
    """One step: seconds per host phase (``PHASES``, tiling the step), the step's wall time,
    the forward's GPU time (None off CUDA) and the batch's shape."""

    phases_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    gpu_forward_s: float | None = None
    num_seqs: int = 0
    num_tokens: int = 0
    num_decode_rows: int = 0

    @property
    def kind(self) -> str:
        """``decode`` (one new token a sequence), ``prefill`` (no decode row), ``mixed``, or
        ``idle``: a call that scheduled nothing (one step ahead, the call after a batch whose
        sequences all ended only collects that batch's tokens)."""
        if not self.num_tokens:
            return "idle"
        if self.num_tokens == self.num_decode_rows:
            return "decode"
        return "mixed" if self.num_decode_rows else "prefill"

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "wall_s": self.wall_s,
            "gpu_forward_s": self.gpu_forward_s,
            "num_seqs": self.num_seqs,
            "num_tokens": self.num_tokens,
            "num_decode_rows": self.num_decode_rows,
            "phases_s": dict(self.phases_s),
        }


class NullTimeline:
    """The timeline of an engine nobody profiles: every mark is a no-op."""

    def begin(self) -> None: ...

    def mark(self, phase: str) -> None: ...

    def forward_started(self) -> None: ...

    def forward_ended(self) -> None: ...

    def end(self, num_seqs: int, num_tokens: int, num_decode_rows: int) -> None: ...


NULL_TIMELINE = NullTimeline()


class StepTimeline:
    """Collects ``TimedPhases`` of every step while attached. ``clock``: seconds (the wall
    clock; tests pass their own). ``device``: CUDA events time the forward there."""

    def __init__(
        self, device: torch.device | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.clock = clock
        self.cuda = device is not None and device.type == "cuda"
        self.steps: list[TimedPhases] = []
        self._current: TimedPhases | None = None
        self._last = 0.0
        self._start = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._forward_ended = False  # a forward that raised records no end: nothing to read
        self._pending: list[tuple[TimedPhases, torch.cuda.Event, torch.cuda.Event]] = []

    def records(self) -> list[TimedPhases]:
        """Every step so far, the GPU times of the forward passes filled in (this waits for
        the last one to end)."""
        for step, start, end in self._pending:
            end.synchronize()
            step.gpu_forward_s = start.elapsed_time(end) / 1e3
        self._pending.clear()
        return self.steps

    def begin(self) -> None:
        """A step starts now."""
        self._current = TimedPhases()
        self._start = self._last = self.clock()

    def mark(self, phase: str) -> None:
        """``phase`` (one of ``PHASES``) ended now: its span is from the previous mark. A phase
        marked twice in a step adds up (containment may re-run a step's parts)."""
        if self._current is None:
            return
        now = self.clock()
        phases = self._current.phases_s
        phases[phase] = phases.get(phase, 0.0) + now - self._last
        self._last = now

    def forward_started(self) -> None:
        """On CUDA: an event before the forward's first launch."""
        if self.cuda and self._current is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events, self._forward_ended = (start, end), False

    def forward_ended(self) -> None:
        """On CUDA: an event after the forward's last launch (read at the end of the step)."""
        if self._events is not None:
            self._events[1].record()
            self._forward_ended = True

    def end(self, num_seqs: int, num_tokens: int, num_decode_rows: int) -> TimedPhases | None:
        """The step ended now: closes ``update``, fills in the batch and the GPU time, keeps
        the record and returns it (None when no step began)."""
        step = self._current
        if step is None:
            return None
        self.mark("update")
        step.wall_s = self._last - self._start
        step.num_seqs, step.num_tokens, step.num_decode_rows = num_seqs, num_tokens, num_decode_rows
        if self._events is not None and self._forward_ended:
            self._pending.append((step, *self._events))  # read in ``records``: not to stall
        self._events = None
        self.steps.append(step)
        self._current = None
        return step


def summarize(steps: list[TimedPhases]) -> dict[str, dict]:
    """Per kind of step (prefill, mixed, decode): how many, and the median seconds of the
    wall, of each phase and of the forward's GPU time; ``host_hidden`` the median share of the
    GPU forward the host's own phases fit under (1.0: the host is off the critical path)."""
    by_kind: dict[str, list[TimedPhases]] = {}
    for step in steps:
        by_kind.setdefault(step.kind, []).append(step)
    out = {}
    for kind, group in by_kind.items():
        gpu = [s.gpu_forward_s for s in group if s.gpu_forward_s is not None]
        row = {
            "steps": len(group),
            "wall_s": statistics.median(s.wall_s for s in group),
            "phases_s": {
                p: statistics.median(s.phases_s.get(p, 0.0) for s in group) for p in PHASES
            },
        }
        if gpu:
            row["gpu_forward_s"] = statistics.median(gpu)
            hidden = [min(1.0, (s.gpu_forward_s or 0) / s.wall_s) for s in group if s.wall_s]
            row["gpu_share_of_wall"] = statistics.median(hidden)
        out[kind] = row
    return out
