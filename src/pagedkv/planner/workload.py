"""The workload the planner prices: K live sequences, their lengths and their shared prefixes.

Given as parameters (``Workload.from_parameters``) or from a trace's requests
(``TraceStats.from_requests`` over ``pagedkv.traces.load_trace``, the one trace reader, whose
prefix rule ``simulate`` shares). A trace gives the *distributions* (lengths, prefixes);
``num_seqs`` says how many are live at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.traces import TraceRequest, reusable_prefix_tokens


@dataclass(frozen=True)
class Workload:
    """A snapshot of ``num_seqs`` live sequences (validated on construction; immutable).

    ``prefix_lens_tokens`` is the distribution of shared-prefix lengths P (each entry one
    equally likely value); ``num_prefix_hits`` (H) is how many of the live sequences reuse one.
    ``seq_lens_tokens``, when set (a trace), is a sample of lengths: the exact ledgers are taken
    over it and scaled to ``num_seqs``.
    """

    num_seqs: int
    mean_len_tokens: float
    max_len_tokens: int
    prefix_lens_tokens: tuple[int, ...] = ()
    num_prefix_hits: int = 0
    seq_lens_tokens: tuple[int, ...] | None = None
    source: str = "parameters"

    def __post_init__(self) -> None:
        if self.num_seqs < 1:
            raise UsageError(f"num_seqs (K) must be >= 1, got {self.num_seqs}", "num_seqs")
        if self.max_len_tokens < 1:
            raise UsageError(f"max_len must be >= 1 token, got {self.max_len_tokens}", "max_len")
        # `not a <= x <= b` rather than `x < a or x > b`: it also refuses NaN
        if not 0 <= self.mean_len_tokens <= self.max_len_tokens:
            raise UsageError(
                f"mean_len must be in [0, max_len={self.max_len_tokens}], "
                f"got {self.mean_len_tokens}",
                "mean_len",
            )
        if any(p < 0 for p in self.prefix_lens_tokens):
            raise UsageError("prefix lengths must be >= 0", "prefix_len")
        if self.prefix_lens_tokens and max(self.prefix_lens_tokens) > self.max_len_tokens:
            raise UsageError(
                f"a shared prefix of {max(self.prefix_lens_tokens)} tokens is longer than the "
                f"longest sequence (max_len {self.max_len_tokens})",
                "prefix_len",
            )
        if self.num_prefix_hits < 0:
            raise UsageError(f"prefix hits (H) must be >= 0, got {self.num_prefix_hits}")
        if self.seq_lens_tokens is not None and not self.seq_lens_tokens:
            raise UsageError("a trace workload needs at least one sequence length")

    @classmethod
    def from_parameters(
        cls,
        num_seqs: int,
        mean_len_tokens: float | None = None,
        max_len_tokens: int | None = None,
        prefix_lens_tokens: tuple[int, ...] = (),
        num_prefix_hits: int = 0,
    ) -> Workload:
        """A parametric workload; a missing mean or max length defaults to the other one."""
        if mean_len_tokens is not None:
            mean = float(mean_len_tokens)
        elif max_len_tokens is not None:
            mean = float(max_len_tokens)
        else:
            raise UsageError("give the sequence length: --mean-len and/or --max-len (or --trace)")
        max_len = int(max_len_tokens if max_len_tokens is not None else -(-mean // 1))
        return cls(num_seqs, mean, max_len, tuple(prefix_lens_tokens), num_prefix_hits)


@dataclass(frozen=True)
class TraceStats:
    """What a trace says: every request's final length and its reusable-prefix length."""

    path: str
    seq_lens_tokens: tuple[int, ...]
    prefix_lens_tokens: tuple[int, ...]  # one per request; 0 = no reusable prefix

    @classmethod
    def from_requests(cls, path: str, requests: Sequence[TraceRequest]) -> TraceStats:
        """Lengths and prefixes of ``requests`` as read by ``pagedkv.traces.load_trace``.

        A sequence's KV peaks at prompt + generated tokens; its prefix is the reusable prefix
        of ``pagedkv.traces.prefix`` (the rule ``simulate`` uses too)."""
        if not requests:
            raise UsageError(f"trace {path!r} holds no requests")
        return cls(
            path,
            tuple(r.prompt_len_tokens + r.output_len_tokens for r in requests),
            tuple(reusable_prefix_tokens(requests)),
        )

    def to_workload(self, num_seqs: int, num_prefix_hits: int | None = None) -> Workload:
        """K live sequences drawn from this trace; H defaults to K x the trace's hit share."""
        hits = [p for p in self.prefix_lens_tokens if p > 0]
        if num_prefix_hits is None:
            num_prefix_hits = round(num_seqs * len(hits) / len(self.seq_lens_tokens))
        lens = self.seq_lens_tokens
        return Workload(
            num_seqs=num_seqs,
            mean_len_tokens=sum(lens) / len(lens),
            max_len_tokens=max(lens),
            prefix_lens_tokens=tuple(hits),
            num_prefix_hits=num_prefix_hits,
            seq_lens_tokens=lens,
            source=self.path,
        )
