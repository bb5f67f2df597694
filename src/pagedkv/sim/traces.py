"""Request traces: the Azure LLM 2023 CSV and Mooncake JSONL loaders, and token-id expansion.

A prompt is a tuple of *segments* ``(segment_id, num_tokens)``; the tokens of a segment depend
only on its id (``segment_tokens``), so two requests share exactly the leading segments they
have in common, and a block-granular prefix cache of any block size sees exactly that many
shared tokens. Mooncake's ``hash_ids`` are such segments (512-token prefix blocks, the last one
cut to the prompt length); a trace without prefix information gets fresh segment ids per
request, so nothing is shared by accident.
"""

from __future__ import annotations

import csv
import json
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

SEGMENT_TOKENS = 512  # the most tokens one segment holds (Mooncake's hash block size)
# Segment ids a trace does not name are drawn from here up, above Mooncake's ids.
FRESH_SEGMENT_BASE = 4_000_000
_MAX_SEGMENT_ID = (2**32 - 1) // SEGMENT_TOKENS - 1  # keeps every token id below 2**32

Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``prompt`` and ``output`` are segment lists; ``output`` is empty
    unless the trace knows the generated tokens (then later prompts may reuse them)."""

    arrival_time_s: float
    prompt: Segments
    output_len_tokens: int
    output: Segments = ()

    @property
    def prompt_len_tokens(self) -> int:
        return sum(n for _, n in self.prompt)


def segment_tokens(segments: Segments) -> array:
    """The token ids of ``segments``: segment ``s`` holds ``s * 512 + 1 ...`` (never 0)."""
    out = array("I")
    for seg_id, n in segments:
        base = seg_id * SEGMENT_TOKENS + 1
        out.extend(range(base, base + n))
    return out


def split_segments(first_id: int, num_tokens: int) -> Segments:
    """Fresh consecutive segments ``first_id, first_id + 1, ...`` covering ``num_tokens``."""
    if first_id + num_tokens // SEGMENT_TOKENS > _MAX_SEGMENT_ID:
        raise ValueError("the trace is too large for 32-bit token ids")
    full, rest = divmod(num_tokens, SEGMENT_TOKENS)
    segs = [(first_id + i, SEGMENT_TOKENS) for i in range(full)]
    if rest:
        segs.append((first_id + full, rest))
    return tuple(segs)


class FreshSegments:
    """Hands out segment ids no trace uses (deterministic: a counter)."""

    def __init__(self, start: int = FRESH_SEGMENT_BASE) -> None:
        self.next_id = start

    def take(self, num_tokens: int) -> Segments:
        segs = split_segments(self.next_id, num_tokens)
        self.next_id += len(segs)
        return segs


def _line_error(path: Path, lineno: int, what: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: {what}")


BadLineHandler = Callable[[ValueError], None]


def _raise(error: ValueError) -> None:
    raise error


def _parse_azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (7 fraction digits)."""
    whole, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return stamp + (float(f"0.{frac}") if frac else 0.0)


def _iter_azure(path: Path, fresh: FreshSegments, bad: BadLineHandler) -> Iterator[TraceRequest]:
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != [
            "TIMESTAMP",
            "ContextTokens",
            "GeneratedTokens",
        ]:
            raise _line_error(
                path, 1, "expected the header TIMESTAMP,ContextTokens,GeneratedTokens"
            )
        t0: float | None = None
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                t = _parse_azure_time(row[0])
                prompt, output = int(row[1]), int(row[2])
                if prompt < 1 or output < 0:
                    raise ValueError("token counts must be positive")
            except (ValueError, IndexError) as exc:
                bad(_line_error(path, lineno, f"cannot parse {','.join(row)!r}: {exc}"))
                continue
            t0 = t if t0 is None else t0
            yield TraceRequest(t - t0, fresh.take(prompt), max(output, 1))


def _iter_mooncake(path: Path, fresh: FreshSegments, bad: BadLineHandler) -> Iterator[TraceRequest]:
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                t_ms, n_in, n_out = rec["timestamp"], rec["input_length"], rec["output_length"]
                hash_ids = rec.get("hash_ids") or []
                if n_in < 1 or n_out < 0:
                    raise ValueError("token counts must be positive")
                if len(hash_ids) != -(-n_in // SEGMENT_TOKENS):
                    raise ValueError(f"{len(hash_ids)} hash_ids for {n_in} input tokens")
                if any(not 0 <= h < FRESH_SEGMENT_BASE for h in hash_ids):
                    raise ValueError(f"hash ids must lie in [0, {FRESH_SEGMENT_BASE})")
            except (ValueError, KeyError, TypeError) as exc:
                bad(_line_error(path, lineno, f"cannot parse a Mooncake record: {exc}"))
                continue
            segs = [(h, SEGMENT_TOKENS) for h in hash_ids]
            last_len = n_in - SEGMENT_TOKENS * (len(segs) - 1)
            segs[-1] = (hash_ids[-1], last_len)
            yield TraceRequest(t_ms / 1000.0, tuple(segs), max(n_out, 1))


def load_trace(
    path: str | Path,
    max_requests: int | None = None,
    rate_scale: float = 1.0,
    on_bad_line: BadLineHandler = _raise,
) -> list[TraceRequest]:
    """Read an Azure ``.csv`` or Mooncake ``.jsonl`` trace, sorted by arrival, arrivals relative
    to the first request and divided by ``rate_scale`` (2.0 = twice the request rate).
    A record that does not parse becomes a ValueError naming the file and line, passed to
    ``on_bad_line``: raised by default; a handler that returns skips the record."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {str(path)!r}")
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if path.suffix == ".csv":
        it = _iter_azure(path, FreshSegments(), on_bad_line)
    elif path.suffix in (".jsonl", ".json"):
        it = _iter_mooncake(path, FreshSegments(), on_bad_line)
    else:
        raise ValueError(f"unknown trace format {path.suffix!r}: expected .csv (Azure) or .jsonl")
    requests: list[TraceRequest] = []
    for req in it:
        if max_requests is not None and len(requests) >= max_requests:
            break
        requests.append(req)
    return rescale(requests, rate_scale)


def rescale(requests: Sequence[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """Sorted by arrival, times shifted to start at 0 and divided by ``rate_scale``."""
    ordered = sorted(requests, key=lambda r: r.arrival_time_s)
    if not ordered:
        return []
    t0 = ordered[0].arrival_time_s
    return [
        TraceRequest((r.arrival_time_s - t0) / rate_scale, r.prompt, r.output_len_tokens, r.output)
        for r in ordered
    ]
