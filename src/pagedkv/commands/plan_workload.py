"""``pagedkv plan``'s workload from its flags: live sequences, their lengths and shared
prefixes, given as numbers or read from a trace."""

from __future__ import annotations

import argparse
import sys

from pagedkv.errors import UsageError
from pagedkv.units import parse_count, parse_tokens

MAX_PREFIX_RANGE_VALUES = 2**18  # the ledgers average over every value of the range


def _prefixes(args: argparse.Namespace, max_len: int) -> tuple[int, ...]:
    """The P distribution; every P at most ``max_len`` (checked before anything is built)."""
    if args.prefix_len is not None and args.prefix_range is not None:
        raise UsageError("give --prefix-len or --prefix-range, not both")
    if args.prefix_len is not None:
        prefix = parse_tokens("--prefix-len", args.prefix_len)
        if prefix > max_len:
            raise UsageError(
                f"--prefix-len: a {prefix}-token prefix is longer than the sequence "
                f"(max length {max_len} tokens)",
                "--prefix-len",
            )
        return (prefix,)
    if args.prefix_range is not None:
        parts = args.prefix_range.split(":")
        if len(parts) != 2:
            raise UsageError(f"--prefix-range: expected A:B, got {args.prefix_range!r}")
        low, high = (parse_tokens("--prefix-range", part) for part in parts)
        if not 0 < low <= high:
            raise UsageError(f"--prefix-range: need 0 < A <= B, got {args.prefix_range!r}")
        if high > max_len:
            raise UsageError(
                f"--prefix-range: B = {high} tokens is longer than the sequence (max length "
                f"{max_len} tokens)",
                "--prefix-range",
            )
        if high - low + 1 > MAX_PREFIX_RANGE_VALUES:
            raise UsageError(
                f"--prefix-range: at most {MAX_PREFIX_RANGE_VALUES:,} values, got "
                f"{high - low + 1:,}",
                "--prefix-range",
            )
        return tuple(range(low, high + 1))
    return ()


def _trace_workload(args: argparse.Namespace, num_seqs: int, hits: int | None):
    from pagedkv.planner.workload import TraceStats
    from pagedkv.traces import load_trace, skipped_lines_note

    skipped: list[UsageError] = []
    lenient = {} if args.strict else {"on_bad_line": skipped.append}
    requests = load_trace(args.trace, **lenient)
    if skipped:  # the same rule and note as `simulate`: one bad record costs only itself
        print(f"pagedkv plan: warning: {skipped_lines_note(skipped)}", file=sys.stderr)
    return TraceStats.from_requests(args.trace, requests).to_workload(num_seqs, hits)


def workload_from_args(args: argparse.Namespace):
    """``plan``'s workload: ``--num-seqs`` live sequences of the given lengths and prefixes, or
    a trace's (one ``UsageError`` line for flags that contradict each other or the lengths)."""
    from pagedkv.planner.workload import Workload

    if args.num_seqs is None:
        raise UsageError("give --num-seqs K (live sequences at once)")
    num_seqs = parse_count("--num-seqs", args.num_seqs)
    hits = None if args.prefix_hits is None else parse_count("--prefix-hits", args.prefix_hits)
    if args.trace is not None:
        given = (args.mean_len, args.max_len, args.prefix_len, args.prefix_range)
        if any(v is not None for v in given):
            raise UsageError(
                "--trace gives lengths and prefixes: drop --mean-len/--max-len/--prefix-*"
            )
        return _trace_workload(args, num_seqs, hits)
    mean_len = None if args.mean_len is None else parse_tokens("--mean-len", args.mean_len)
    max_len = None if args.max_len is None else parse_tokens("--max-len", args.max_len)
    lengths = Workload.from_parameters(num_seqs, mean_len, max_len)  # validates the lengths
    prefixes = _prefixes(args, lengths.max_len_tokens)
    if hits is None:
        hits = num_seqs if prefixes else 0  # every live sequence carries the shared prefix
    return Workload.from_parameters(num_seqs, mean_len, max_len, prefixes, hits)
