"""The workload the planner prices: K live sequences, their lengths and their shared prefixes.

Given as parameters (``Workload.from_parameters``) or read from a trace (``load_trace``):
Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) or Mooncake JSONL
(``input_length``, ``output_length``, ``hash_ids`` = ids of 512-token prefix blocks). A trace
gives the *distributions* (lengths, prefixes); ``num_seqs`` says how many are live at once.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_HASH_BLOCK_TOKENS = 512  # Mooncake's hash_ids each name one 512-token prefix block


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
            raise ValueError(f"num_seqs (K) must be >= 1, got {self.num_seqs}")
        if self.max_len_tokens < 1:
            raise ValueError(f"max_len must be >= 1 token, got {self.max_len_tokens}")
        if not 0 <= self.mean_len_tokens <= self.max_len_tokens:
            raise ValueError(
                f"mean_len must be in [0, max_len={self.max_len_tokens}], "
                f"got {self.mean_len_tokens}"
            )
        if any(p < 0 for p in self.prefix_lens_tokens):
            raise ValueError("prefix lengths must be >= 0")
        if self.num_prefix_hits < 0:
            raise ValueError(f"prefix hits (H) must be >= 0, got {self.num_prefix_hits}")
        if self.seq_lens_tokens is not None and not self.seq_lens_tokens:
            raise ValueError("a trace workload needs at least one sequence length")

    @property
    def total_tokens(self) -> float:
        """N = K * mean length."""
        return self.num_seqs * self.mean_len_tokens

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
        if mean_len_tokens is None and max_len_tokens is None:
            raise ValueError("give the sequence length: --mean-len and/or --max-len (or --trace)")
        mean = float(mean_len_tokens if mean_len_tokens is not None else max_len_tokens)
        max_len = int(max_len_tokens if max_len_tokens is not None else -(-mean // 1))
        return cls(num_seqs, mean, max_len, tuple(prefix_lens_tokens), num_prefix_hits)


@dataclass(frozen=True)
class TraceStats:
    """What a trace file says: every request's final length and its shared-prefix length."""

    path: str
    seq_lens_tokens: tuple[int, ...]
    prefix_lens_tokens: tuple[int, ...]  # one per request; 0 = no reusable prefix

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


def load_trace(path: str | Path) -> TraceStats:
    """Read an Azure CSV or a Mooncake JSONL trace (ValueError with one line if unreadable)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace {str(path)!r}: {exc}") from None
    first_line = text.lstrip().split("\n", 1)[0]
    try:
        if first_line.startswith("{"):
            lens, prefixes = _parse_mooncake(text)
        else:
            lens, prefixes = _parse_azure(text)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot parse trace {str(path)!r}: {exc}") from None
    if not lens:
        raise ValueError(f"trace {str(path)!r} holds no requests")
    return TraceStats(str(path), tuple(lens), tuple(prefixes))


def _parse_azure(text: str) -> tuple[list[int], list[int]]:
    # A sequence's KV peaks at context + generated tokens; Azure traces carry no prefix data.
    rows = csv.DictReader(text.splitlines())
    lens = [int(row["ContextTokens"]) + int(row["GeneratedTokens"]) for row in rows]
    return lens, [0] * len(lens)


def _parse_mooncake(text: str) -> tuple[list[int], list[int]]:
    # hash_ids are chained (an id names the whole prefix up to its block), so a request's
    # reusable prefix is its run of leading ids that some earlier request already produced.
    seen: set[int] = set()
    lens: list[int] = []
    prefixes: list[int] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        input_len = int(record["input_length"])
        hash_ids = [int(h) for h in record.get("hash_ids", [])]
        num_hit_blocks = 0
        while num_hit_blocks < len(hash_ids) and hash_ids[num_hit_blocks] in seen:
            num_hit_blocks += 1
        prefixes.append(min(num_hit_blocks * MOONCAKE_HASH_BLOCK_TOKENS, input_len))
        lens.append(input_len + int(record["output_length"]))
        seen.update(hash_ids)
    return lens, prefixes
