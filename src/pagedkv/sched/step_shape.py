"""A step's shape: what one engine step computes, counted the same way by the engine's profiler
and by the simulator's cost models.

It lives in ``sched`` (below both ``engine`` and ``sim``) because it is a fact about a
scheduled batch, not about a model or a clock: the engine times real steps of a shape, the
simulator prices steps of a shape, and both must count identically.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What a step computes. ``kv_read_tokens``: context tokens attended to, summed over the
    sequences (each new token's own position included); ``attention_pairs``: query-key pairs
    (causal, so a chunk of ``n`` new tokens after ``c`` cached ones has ``n*c + n*(n+1)/2``).

    The block-aware fields (zero where a caller does not know them): ``num_seqs`` in the batch,
    ``num_decode_seqs`` of them computing exactly one token after a computed context,
    ``kv_blocks_read`` = sum over the sequences of ceil(context / block_size), the blocks an
    attention kernel walks (a partly used tail block counts whole), ``block_size`` in
    tokens, and ``decode_kv_tokens``: the context tokens the decode sequences attend to (their
    part of ``kv_read_tokens``)."""

    num_batched_tokens: int
    kv_read_tokens: int
    attention_pairs: int
    num_seqs: int = 0
    num_decode_seqs: int = 0
    kv_blocks_read: int = 0
    block_size: int = 1
    decode_kv_tokens: int = 0

    @classmethod
    def of(cls, items: Iterable[tuple[int, int]], block_size: int) -> StepShape:
        """The shape of a step whose sequences compute ``n`` new tokens after ``start``
        computed ones, for each ``(start, n)`` of ``items``: the one count the simulator and
        the engine's profiler share."""
        tokens = kv_read = pairs = seqs = decode = blocks = decode_kv = 0
        for start, n in items:
            seqs += 1
            tokens += n
            kv_read += start + n
            pairs += n * start + n * (n + 1) // 2
            blocks += -(-(start + n) // block_size)
            if n == 1 and start > 0:
                decode += 1
                decode_kv += start + 1
        return cls(tokens, kv_read, pairs, seqs, decode, blocks, block_size, decode_kv)


@dataclass(frozen=True)
class TimedStep:
    """One measured engine step: what it computed and how long it took (wall seconds)."""

    shape: StepShape
    seconds: float
