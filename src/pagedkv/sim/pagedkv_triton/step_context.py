"""A step's shape with its longest context, for the clock of pagedkv's own engine.

``StepShape`` (``sched/step_shape.py``) counts a step in sums: tokens, context tokens, blocks.
pagedkv's Triton decode kernel also waits for the step's *longest* sequence: its last program
walks that sequence's blocks after the others have ended (``sim/pagedkv_triton/decode_law.py``), and the
kernel's split rule reads the longest context (``pages/triton_splits.decode_splits``). A mean
cannot say that: the H200 check's run decodes 246 sequences of 830 tokens on average and
2,070 at most, whose last program walks 2.5x the mean chain.

``LongestShape`` is a ``StepShape`` that also carries ``max_context_tokens`` (the longest
sequence's context after the step); the simulator's replica builds one for every step, and a
timed step that recorded it (``sections.clock`` of a device check) reads as one. Every other
cost model sees a plain ``StepShape``. ``longest_context_tokens`` is what a cost model asks:
the longest when the shape knows it, else 0 (then the mean stands in, as before). The field
belongs in ``StepShape`` itself, where the engine's profiler would record it for every timed
step; until then it lives here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pagedkv.sched.step_shape import StepShape


@dataclass(frozen=True)
class LongestShape(StepShape):
    """``StepShape`` + ``max_context_tokens`` (0 = not known)."""

    max_context_tokens: int = 0

    @classmethod
    def of(cls, items: Iterable[tuple[int, int]], block_size: int) -> LongestShape:
        """``StepShape.of`` of the same ``(start, n)`` items, and the longest ``start + n``."""
        pairs = list(items)
        base = StepShape.of(pairs, block_size)
        return cls(**asdict(base), max_context_tokens=max((s + n for s, n in pairs), default=0))


def longest_context_tokens(shape: StepShape) -> int:
    """The step's longest context in tokens, or 0 when ``shape`` does not know it."""
    return shape.max_context_tokens if isinstance(shape, LongestShape) else 0
