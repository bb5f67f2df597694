"""The one reader of trace files: Azure LLM inference 2023 CSV and Mooncake JSONL.

* Azure (``.csv``): header ``TIMESTAMP,ContextTokens,GeneratedTokens``; no prefix information,
  so every prompt is a fresh segment (nothing is shared by accident).
* Both: token counts are whole numbers in ``[1, 2^40]`` (prompt) or ``[0, 2^40]`` (output).
* Mooncake (``.jsonl``): one JSON object per line with ``timestamp`` (ms), ``input_length``,
  ``output_length`` and ``hash_ids``, the ids of the prompt's 512-token prefix blocks (chained:
  an id names the whole prefix up to its block). A record must hold exactly
  ``ceil(input_length / 512)`` ids; a record that contradicts itself (3 ids for 700 tokens) is a
  bad record like any other.

A bad record (not JSON, not valid UTF-8, a missing field, a string or non-finite timestamp, a
fractional or negative length, a fractional or out-of-range hash id, too few or too many ids)
becomes one ``UsageError`` naming ``FILE:LINE``, handed to ``on_bad_line``: raised by default; a
handler that returns skips the record (``pagedkv plan`` and ``simulate`` skip with a warning
unless ``--strict``). A file that is missing, a directory, or a CSV with the wrong columns is a
``UsageError`` at once: nothing in it can be read.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.traces.segments import (
    FRESH_SEGMENT_BASE,
    SEGMENT_TOKENS,
    FreshSegments,
    TraceRequest,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_RECORD_TOKENS = 2**40  # a length beyond this is a broken record (and overflows a float mean)
BadLineHandler = Callable[[UsageError], None]


def _raise(error: UsageError) -> None:
    raise error


def _lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number, text) per line; text None when the line is not valid UTF-8."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, None


def _parse_azure_time(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (7 fraction digits)."""
    whole, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    if frac and not frac.isdecimal():
        raise ValueError(f"bad fraction of a second {frac!r}")
    return stamp + (float(f"0.{frac}") if frac else 0.0)


def _count(text: str, name: str, minimum: int) -> int:
    if not text.strip().lstrip("-").isdecimal():
        raise ValueError(f"{name} must be a whole number of tokens, got {text!r}")
    if len(text.strip()) > 20 or not minimum <= int(text) <= MAX_RECORD_TOKENS:
        raise ValueError(f"{name} must be in [{minimum}, {MAX_RECORD_TOKENS}], got {text.strip()}")
    return int(text)


def _iter_azure(path: Path, fresh: FreshSegments, bad: BadLineHandler) -> Iterator[TraceRequest]:
    lines = _lines(path)
    _, header_text = next(lines, (1, ""))
    header = next(csv.reader([header_text or ""]), [])
    if tuple(h.strip() for h in header[:3]) != AZURE_COLUMNS:
        raise UsageError(
            f"{path}:1: expected the columns {','.join(AZURE_COLUMNS)} (an Azure LLM 2023 "
            f"trace), got {','.join(header)!r}"
        )
    for lineno, text in lines:
        if text is None:
            bad(UsageError(f"{path}:{lineno}: the line is not valid UTF-8"))
            continue
        if not text.strip():
            continue
        row = next(csv.reader([text]))
        try:
            if len(row) < 3:
                raise ValueError(f"expected {len(AZURE_COLUMNS)} columns, got {len(row)}")
            t = _parse_azure_time(row[0])
            prompt = _count(row[1], "ContextTokens", 1)
            output = _count(row[2], "GeneratedTokens", 0)
        except ValueError as exc:
            bad(UsageError(f"{path}:{lineno}: cannot parse {text.strip()!r}: {exc}"))
            continue
        yield TraceRequest(t, fresh.take(prompt), output)


def _whole(record: dict[str, Any], name: str, minimum: int) -> int:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if not minimum <= value <= MAX_RECORD_TOKENS:
        raise ValueError(f"{name} must be in [{minimum}, {MAX_RECORD_TOKENS}], got {value!r}")
    return int(value)


def _mooncake_record(record: Any) -> TraceRequest:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for name in ("timestamp", "input_length", "output_length"):
        if name not in record:
            raise ValueError(f"missing field {name!r}")
    t_ms = record["timestamp"]
    if isinstance(t_ms, bool) or not isinstance(t_ms, int | float) or not math.isfinite(t_ms):
        raise ValueError(f"timestamp must be a finite number of ms, got {t_ms!r}")
    n_in = _whole(record, "input_length", 1)
    n_out = _whole(record, "output_length", 0)
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list):
        raise ValueError(f"hash_ids must be a list of block ids, got {hash_ids!r}")
    expected = -(-n_in // SEGMENT_TOKENS)
    if len(hash_ids) != expected:  # checked before the ids themselves: it bounds the work
        raise ValueError(
            f"{len(hash_ids)} hash_ids for {n_in} input tokens (a record needs one id per "
            f"{SEGMENT_TOKENS} tokens: {expected})"
        )
    for h in hash_ids:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < FRESH_SEGMENT_BASE:
            raise ValueError(f"hash ids must be integers in [0, {FRESH_SEGMENT_BASE}), got {h!r}")
    segs = [(h, SEGMENT_TOKENS) for h in hash_ids]
    segs[-1] = (hash_ids[-1], n_in - SEGMENT_TOKENS * (len(segs) - 1))
    return TraceRequest(t_ms / 1000.0, tuple(segs), n_out)


def _iter_mooncake(path: Path, bad: BadLineHandler) -> Iterator[TraceRequest]:
    for lineno, text in _lines(path):
        if text is None:
            bad(UsageError(f"{path}:{lineno}: the line is not valid UTF-8"))
            continue
        if not text.strip():
            continue
        try:
            yield _mooncake_record(json.loads(text))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            bad(UsageError(f"{path}:{lineno}: cannot parse a Mooncake record: {exc}"))


def _format(path: Path) -> str:
    if path.suffix == ".csv":
        return "azure"
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    with path.open("rb") as f:  # another name: tell by the first bytes
        head = f.read(64).lstrip()
    if head.startswith(b"{"):
        return "mooncake"
    if head.startswith(AZURE_COLUMNS[0].encode()):
        return "azure"
    raise UsageError(
        f"{path}: unknown trace format: expected an Azure .csv (header "
        f"{','.join(AZURE_COLUMNS)}) or a Mooncake .jsonl"
    )


def load_trace(
    path: str | Path,
    max_requests: int | None = None,
    rate_scale: float = 1.0,
    on_bad_line: BadLineHandler = _raise,
) -> list[TraceRequest]:
    """The requests of an Azure ``.csv`` or Mooncake ``.jsonl`` trace (the first
    ``max_requests`` good records), sorted by arrival, arrivals relative to the first request
    and divided by ``rate_scale`` (2.0 = twice the request rate). See the module docstring for
    what a bad record is and what ``on_bad_line`` does with it."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{str(path)!r} is a directory, not a trace file (.csv or .jsonl)")
    if not path.is_file():
        raise UsageError(f"no trace file {str(path)!r}")
    if max_requests is not None and max_requests < 1:
        raise UsageError(f"max_requests must be >= 1, got {max_requests}")
    try:
        if _format(path) == "azure":
            it = _iter_azure(path, FreshSegments(), on_bad_line)
        else:
            it = _iter_mooncake(path, on_bad_line)
        requests: list[TraceRequest] = []
        for req in it:
            if max_requests is not None and len(requests) >= max_requests:
                break
            requests.append(req)
    except OSError as exc:
        raise UsageError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None
    return rescale(requests, rate_scale)


def rescale(requests: Sequence[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """Sorted by arrival, times shifted to start at 0 and divided by ``rate_scale`` (a finite
    number > 0)."""
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise UsageError(f"rate_scale must be a finite number > 0, got {rate_scale}", "rate_scale")
    ordered = sorted(requests, key=lambda r: r.arrival_time_s)
    if not ordered:
        return []
    t0 = ordered[0].arrival_time_s
    if not math.isfinite((ordered[-1].arrival_time_s - t0) / rate_scale):
        raise UsageError("the trace's arrival times span more than a float can hold")
    return [
        TraceRequest((r.arrival_time_s - t0) / rate_scale, r.prompt, r.output_len_tokens, r.output)
        for r in ordered
    ]


def skipped_lines_note(skipped: Sequence[UsageError]) -> str:
    """The one warning line both commands print when bad records were skipped."""
    shown = "; ".join(str(e) for e in skipped[:3])
    more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
    return f"skipped {len(skipped)} unparsable line(s): {shown}{more}; --strict makes this an error"
