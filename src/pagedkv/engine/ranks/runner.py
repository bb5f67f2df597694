"""``RankRunner``: a ``ModelRunner`` that is one of the engine's tensor-parallel ranks.

Every rank runs ``ModelRunner.run_step`` on the same step; what differs is said here. Rank 0
(its ``link`` set: the workers) sends the step before it runs it, turns any failure inside the
step into ``RankFailure`` (the ranks' collectives are out of step: the engine ends), and has
the workers join it for logits outside a step (prompt scoring). A step scheduled one step
ahead takes its placeholders' ids from the draws on rank 0's device: one broadcast of the
device ids brings them to the workers, no host read.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedkv.engine.runner import ModelRunner, StepInputs, StepOutput
from pagedkv.engine.step.draws import PendingDraws
from pagedkv.model.parallel import TPGroup
from pagedkv.sched.batch import ScheduledBatch


class RankLink(Protocol):
    """Rank 0's link to the other ranks (``workers.Workers``)."""

    def send_step(self, batch: ScheduledBatch, inputs: StepInputs | None) -> None:
        """Send the step to every other rank, before rank 0 runs it."""
        ...

    def send_logits(self, rows: int) -> None:
        """Have every other rank compute logits of ``rows`` rows rank 0 broadcasts next."""
        ...

    def failure_of(self, exc: BaseException | None) -> Exception:
        """The engine-ending error for a step that raised ``exc`` on rank 0."""
        ...


class RankRunner(ModelRunner):
    """``ModelRunner``'s arguments, then this rank's ``group``; ``link`` (rank 0's, set once
    the workers built their pools) sends them each step."""

    def __init__(self, *args, group: TPGroup, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tp = group
        self.link: RankLink | None = None

    def run_step(
        self, batch: ScheduledBatch, inputs: StepInputs | None, prev: PendingDraws | None
    ) -> StepOutput:
        if self.link is None:  # a worker (or rank 0 before its workers are built)
            return super().run_step(batch, inputs, prev)
        self.link.send_step(batch, inputs)
        try:
            return super().run_step(batch, inputs, prev)
        except Exception as exc:  # the ranks' collectives are out of step: the engine ends
            raise self.link.failure_of(exc) from exc

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank computes its vocabulary rows of ``hidden`` (rank 0's, broadcast)."""
        if self.link is not None:
            self.link.send_logits(hidden.shape[0])
            hidden = self.tp.broadcast_first(hidden)
        return self.model.compute_logits(hidden)

    def _drawn_ids(self, inputs: StepInputs, prev: PendingDraws | None) -> torch.Tensor:
        """Rank 0's step ids with its placeholders' drawn ids, on every rank's device."""
        if self.tp.rank == 0:
            return self.tp.broadcast_first(super()._drawn_ids(inputs, prev))
        return self.tp.broadcast_first(inputs.input_ids.to(self.device, non_blocking=True))
