"""``StepLoop``: the engine's one step loop, synchronous or one step ahead, over shared phases.

Every step is made of the same phases: **schedule** (the scheduler's batch, its refusals handed
to their requests), **forward** (``ModelRunner.execute``: prepare, KV copies, the forward pass,
the logits), **launch draws** (``step/draws.launch``: queued on the device, no host sync),
**collect** (the ids copied to the host once, the grammars advanced) and **finish** (tokens
into their requests, stop strings, the scheduler's ``update``, stats, KV events). A
synchronous step runs them in that order. One step ahead (vLLM v1's asynchronous scheduling,
pagedkv's own code) each ``step()`` schedules step N + 1 while the device still runs step N's
forward pass (``Scheduler.commit_ahead`` counts N's tokens as computed and gives each sequence
that draws one token a placeholder), launches N's draws, launches N + 1's forward (its
placeholders' ids gathered from N's draws on the device), then collects and finishes N while
N + 1 computes: the host's bookkeeping overlaps the device. mini-sglang's overlap loop has the
same shape, with a device-side token pool instead of placeholders.

A request's tokens are the same either way (seeded draws depend on (seed, position) only);
one step ahead a sequence that stops at N has computed one token too many in N + 1 (dropped),
``n > 1`` forks join a step later and outputs arrive a step later. Failures stay contained
(``containment.py``): N's draws failing are drawn again entry by entry from N's logits; N + 1's
forward failing runs N + 1 again synchronously, entry by entry, once N is finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.runner import ModelRunner, StepOutput
from pagedkv.engine.step.containment import Failures, run_contained, split_failures
from pagedkv.engine.step.draws import Draws, PendingDraws, collect, launch, sample_batch
from pagedkv.engine.step.record import StepRecord
from pagedkv.engine.step.timeline import NULL_TIMELINE, NullTimeline, StepTimeline
from pagedkv.kvcache.protocol import KVAllocator
from pagedkv.sched.batch import ScheduledBatch
from pagedkv.sched.scheduler import Scheduler


@dataclass(frozen=True)
class InFlight:
    """A step whose forward pass is queued and whose draws are not: what the next call
    collects."""

    batch: ScheduledBatch
    out: StepOutput
    touched: set[str]
    started: float


class StepLoop:
    """The step of one engine (module docstring). Engine thread only."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        allocator: KVAllocator,
        record: StepRecord,
        ahead: bool,
    ) -> None:
        self.scheduler, self.runner, self.allocator = scheduler, runner, allocator
        self.record = record  # the requests' side: refusals, tokens, failures, stats, events
        self.ahead = ahead
        self.inflight: InFlight | None = None
        self.timeline: StepTimeline | NullTimeline = NULL_TIMELINE

    @property
    def busy(self) -> bool:
        """A step is computing whose outputs have not been reported yet."""
        return self.inflight is not None

    def step(self) -> list[RequestOutput]:
        """One step (one call: one step ahead, the outputs are the previous step's)."""
        tl = self.timeline
        tl.begin()
        outputs, batch = self._step_ahead() if self.ahead else self._step_sync()
        decode_rows = sum(item.num_new_tokens == 1 for item in batch.seqs)
        tl.end(len(batch.seqs), batch.num_batched_tokens, decode_rows)
        return outputs

    # -- the phases ------------------------------------------------------------------------

    def _schedule(self) -> tuple[ScheduledBatch, set[str], float]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        return batch, self.record.refuse(batch.refused), started

    def _forward(self, batch: ScheduledBatch, prev: PendingDraws | None = None) -> StepOutput:
        return self.runner.execute(batch, self.allocator, prev)

    def _forward_and_draw(self, batch: ScheduledBatch) -> list[Draws | Exception]:
        """A synchronous step's forward, prompt scores and draws (launched and collected)."""
        out = self._forward(batch)
        self.record.score_prompts(batch, out)
        draws = sample_batch(batch, out.logits, self.record.sampling_of)
        self.timeline.mark("sample")
        return draws

    def _finish(
        self,
        batch: ScheduledBatch,
        draws: list[Draws | None],
        failures: Failures,
        touched: set[str],
        started: float,
    ) -> list[RequestOutput]:
        return self.record.finish(batch, draws, failures, touched, started, self.timeline)

    # -- the two modes ---------------------------------------------------------------------

    def _step_sync(self) -> tuple[list[RequestOutput], ScheduledBatch]:
        batch, touched, started = self._schedule()
        self.timeline.mark("schedule")
        draws, failures = run_contained(batch, self._forward_and_draw)
        return self._finish(batch, draws, failures, touched, started), batch

    def _step_ahead(self) -> tuple[list[RequestOutput], ScheduledBatch]:
        prev = self.inflight
        batch, touched, started = self._schedule()
        if batch.seqs:
            self.scheduler.commit_ahead(batch)
        self.timeline.mark("schedule")
        pending: PendingDraws | None = None
        drawn_failure: Exception | None = None
        if prev is not None:
            try:
                pending = launch(prev.batch, prev.out.logits, self.record.sampling_of)
            except Exception as exc:  # noqa: BLE001 - contained: prev's requests fail below
                drawn_failure = exc
            self.timeline.mark("sample")
        out = None
        if batch.seqs and (prev is None or pending is not None):
            try:
                out = self._forward(batch, pending)
            except Exception:  # noqa: BLE001 - retried below, synchronously, entry by entry
                out = None
        outputs = self._finish_prev(prev, pending, drawn_failure) if prev is not None else []
        self.inflight = None
        if out is not None:
            self.inflight = InFlight(batch, out, touched, started)
        elif batch.seqs:  # its tokens are all known now: run it as a synchronous step would
            # (less the sequences that ended since: a failed request's, say)
            batch = replace(batch, seqs=tuple(i for i in batch.seqs if not i.seq.is_finished))
            draws, failures = run_contained(batch, self._forward_and_draw)
            outputs += self._finish(batch, draws, failures, touched, started)
        elif touched or not outputs:  # refusals to report, or an idle step
            outputs += self._finish(batch, [], [], touched, started)
        return outputs, batch

    def _finish_prev(
        self, prev: InFlight, pending: PendingDraws | None, failure: Exception | None
    ) -> list[RequestOutput]:
        """Collect ``prev``'s draws and finish it. Draws that failed are drawn again entry by
        entry from the same logits (``containment.py``): only the entries that fail alone
        fail."""
        failures: Failures
        draws: list[Draws | None]
        try:
            if pending is None:
                raise failure or RuntimeError("the step's draws were not launched")
            draws, failures = split_failures(prev.batch, collect(pending))
        except Exception:  # noqa: BLE001 - contained below
            draws, failures = self._redraw(prev)
        self.timeline.mark("sample")  # the wait for the ids
        self.record.score_prompts(prev.batch, prev.out)
        return self._finish(prev.batch, draws, failures, prev.touched, prev.started)

    def _redraw(self, prev: InFlight) -> tuple[list[Draws | None], Failures]:
        """``prev``'s draws again under ``run_contained``: each entry alone, its own logits
        row (``prev.out.logits`` holds the rows of the entries that need a token, in order)."""
        logits = prev.out.logits
        need = [item for item in prev.batch.seqs if item.needs_logits]
        row_of = {id(item): r for r, item in enumerate(need)}

        def draw_batch(batch: ScheduledBatch) -> list[Draws | Exception]:
            rows = [row_of[id(item)] for item in batch.seqs if item.needs_logits]
            return sample_batch(batch, logits[rows], self.record.sampling_of)

        return run_contained(prev.batch, draw_batch)
