"""``AheadStepper``: an engine that schedules the next step while the device computes this one.

vLLM v1's asynchronous scheduling is the reference design; this is pagedkv's own. A
synchronous step is schedule -> forward -> draw -> copy the ids to the host -> record ->
update, and the device idles through every host part. Here each ``step()`` call is:

1. **schedule step N + 1** on the host while the device still runs step N's forward pass: the
   scheduler counts N's tokens as computed and gives each sequence that draws one token a
   placeholder for it (``Scheduler.commit_ahead``), so N + 1 computes that token;
2. **queue N's draws** on the device (``sample_step.launch``: no host sync), from host state
   that is complete (N - 1's tokens were recorded by the previous call);
3. **queue N + 1's forward pass**, its placeholder ids gathered from N's draws on the device
   (``ModelRunner.execute(..., prev=)``): the host never waits for them;
4. **collect N**: copy its ids to the host (waiting for N's draws only, while N + 1 computes),
   hand them to the requests (stop strings) and to the scheduler (``update`` writes each over
   its placeholder, finishes, forks); return N's outputs.

So the host's scheduling, metadata and bookkeeping overlap the device's forward passes. A
sequence that stops at step N has computed one token too many in N + 1, which is dropped; a
request's tokens are the synchronous engine's (the seeded draws depend on (seed, position)
only), though an ``n > 1`` request's forks join one step later and outputs arrive one step
later. A failure stays contained (``containment.py``): N's draws failing are drawn again entry
by entry from N's logits; N + 1's forward failing runs N + 1 again synchronously, entry by
entry, once N is recorded; only the entries that fail alone fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagedkv.engine.containment import run_contained, split_failures
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.runner import StepOutput
from pagedkv.engine.sample_step import Draws, PendingDraws, collect, launch, sample_batch
from pagedkv.sched.batch import ScheduledBatch, ScheduledSeq

if TYPE_CHECKING:
    from pagedkv.engine.engine import LLMEngine


@dataclass(frozen=True)
class InFlight:
    """A step whose forward pass is queued and whose draws are not: what the next call
    collects."""

    batch: ScheduledBatch
    out: StepOutput
    touched: set[str]
    started: float


class AheadStepper:
    """The step loop of ``engine`` one step ahead (module docstring). Engine thread only."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inflight: InFlight | None = None

    @property
    def busy(self) -> bool:
        """A step is computing whose outputs have not been reported yet."""
        return self.inflight is not None

    def step(self) -> tuple[list[RequestOutput], ScheduledBatch]:
        """One call: the outputs of the step it collected, and the batch it scheduled."""
        e = self.engine
        started = time.perf_counter()
        prev = self.inflight
        batch, touched = e.schedule_step()
        if batch.seqs:
            e.scheduler.commit_ahead(batch)
        e.timeline.mark("schedule")
        pending: PendingDraws | None = None
        drawn_failure: Exception | None = None
        if prev is not None:
            try:
                pending = launch(prev.batch, prev.out.logits, e.sampling_of)
            except Exception as exc:  # noqa: BLE001 - contained: prev's requests fail below
                drawn_failure = exc
            e.timeline.mark("sample")
        out = None
        if batch.seqs and (prev is None or pending is not None):
            try:
                out = e.runner.execute(batch, e.allocator, pending)
            except Exception:  # noqa: BLE001 - retried below, synchronously, entry by entry
                out = None
        outputs = self._finish_prev(prev, pending, drawn_failure) if prev is not None else []
        self.inflight = None
        if out is not None:
            self.inflight = InFlight(batch, out, touched, started)
        elif batch.seqs:  # its tokens are all known now: run it as a synchronous engine would
            # (less the sequences that ended since: a failed request's, say)
            batch = replace(batch, seqs=tuple(i for i in batch.seqs if not i.seq.is_finished))
            draws, failures = run_contained(batch, e._execute_and_sample)
            outputs += e.finish_step(batch, draws, failures, touched, started)
        elif touched or not outputs:  # refusals to report, or an idle step
            outputs += e.finish_step(batch, [], [], touched, started)
        return outputs, batch

    def _finish_prev(
        self, prev: InFlight, pending: PendingDraws | None, failure: Exception | None
    ) -> list[RequestOutput]:
        """Collect ``prev``'s draws and record them (``LLMEngine.finish_step``). Draws that
        failed are drawn again entry by entry from the same logits (``containment.py``), so
        only the entries that fail alone are failed."""
        e = self.engine
        failures: list[tuple[ScheduledSeq, Exception]]
        draws: list[Draws | None]
        try:
            if pending is None:
                raise failure or RuntimeError("the step's draws were not launched")
            draws, failures = split_failures(prev.batch, collect(pending))
        except Exception:  # noqa: BLE001 - contained below
            draws, failures = self._redraw(prev)
        e.timeline.mark("sample")  # the wait for the ids
        e.score_prompts(prev.batch, prev.out)
        return e.finish_step(prev.batch, draws, failures, prev.touched, prev.started)

    def _redraw(self, prev: InFlight) -> tuple[list, list[tuple[ScheduledSeq, Exception]]]:
        """``prev``'s draws again under ``run_contained``: each entry alone, its own logits
        row (``prev.out.logits`` holds the rows of the entries that need a token, in order)."""
        e, logits = self.engine, prev.out.logits
        need = [item for item in prev.batch.seqs if item.needs_logits]
        row_of = {id(item): r for r, item in enumerate(need)}

        def draw_batch(batch: ScheduledBatch) -> list[Draws | Exception]:
            rows = [row_of[id(item)] for item in batch.seqs if item.needs_logits]
            return sample_batch(batch, logits[rows], e.sampling_of)

        return run_contained(prev.batch, draw_batch)
