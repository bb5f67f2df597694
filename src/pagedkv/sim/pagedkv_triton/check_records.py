"""The records of a device check (``benchmarks/gpu_check.py --output``) that a clock of pagedkv's
engine is fitted to, each read and checked (UsageError naming where it sits): the ledger's
decode attention rows (``ledger_rows``; ``ledger_kernels``: which decode kernel timed them) and
timed engine steps (``timed_steps``). ``check_data.py`` reads the file around them.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from pagedkv.errors import UsageError
from pagedkv.sched.step_shape import StepShape, TimedStep
from pagedkv.sim.pagedkv_triton.decode_law import DecodeCall, LedgerRow
from pagedkv.sim.pagedkv_triton.step_context import LongestShape

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_SHAPE_FIELDS = {f.name for f in fields(StepShape)}
LAYOUTS = ("paged", "contiguous")
# What a timed step of the clock section may carry beside its shape, for people reading the
# JSON (the step's Triton compiles, its host phases): not read by the fit.
STEP_NOTES = {"compiles", "compile_s", "host_phases_s"}


def finite_number(value: Any, where: str) -> float:
    """``value`` as a float; UsageError naming ``where`` unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{where} must be a finite number, got {value!r}")
    return float(value)


BLOCK_WALK = (
    "one block per loop iteration (the Triton kernels before commit cf28990; the tile kernels "
    "main runs since walk tiles of T tokens: refit on a device check of those)"
)


def ledger_kernels(ledger: dict) -> str:
    """What decode kernel a ledger timed, from what the ledger records: the tile kernels
    (cf28990 on) write ``tile_tokens``; a ledger without it timed the block-walk kernels."""
    tile = ledger.get("tile_tokens")
    if isinstance(tile, int) and not isinstance(tile, bool) and tile > 0:
        return f"tiles of {tile} tokens gathered through the block table (the tile is not the page)"
    return BLOCK_WALK


def ledger_rows(ledger: dict, where: str, layout: str = "paged") -> tuple[LedgerRow, ...]:
    """The timed rows of ``layout`` (a row without one is paged)."""
    shape = ledger.get("shape")
    if not isinstance(shape, dict) or shape.get("dtype") not in DTYPE_BYTES:
        raise UsageError(f"{where}: ledger.shape needs num_kv_heads, head_dim and a dtype")
    kv, hd = (
        int(finite_number(shape.get("num_kv_heads"), f"{where}: ledger.shape.num_kv_heads")),
        int(finite_number(shape.get("head_dim"), f"{where}: ledger.shape.head_dim")),
    )
    rows = []
    for i, row in enumerate(ledger.get("rows", [])):
        if not isinstance(row, dict) or "median_ms" not in row:
            continue  # refused, skipped or failed: nothing measured
        at = f"{where}: ledger.rows[{i}]"
        if row.get("layout", "paged") not in LAYOUTS:
            raise UsageError(
                f"{at}.layout must be one of {', '.join(LAYOUTS)}, got {row.get('layout')!r}"
            )
        if row.get("layout", "paged") != layout:
            continue
        ms = finite_number(row["median_ms"], f"{at}.median_ms")
        b, ctx = (
            int(finite_number(row.get("block_size"), f"{at}.block_size")),
            finite_number(row.get("context_len"), f"{at}.context_len"),
        )
        n, s = (
            int(finite_number(row.get("batch"), f"{at}.batch")),
            int(finite_number(row.get("num_splits", 1), at)),
        )
        if ms <= 0 or b < 1 or n < 1 or s < 1 or ctx < 1:
            raise UsageError(f"{at}: sizes and time must be > 0")
        call = DecodeCall(n, ctx, b, s, kv, hd, DTYPE_BYTES[shape["dtype"]])
        rows.append(LedgerRow(call, ms / 1e3))
    return tuple(rows)


def timed_steps(records: Any, where: str) -> tuple[TimedStep, ...]:
    """Timed steps: ``StepShape`` fields (a ``LongestShape`` with ``max_context_tokens``) and
    ``seconds`` each; ``STEP_NOTES`` are skipped."""
    if not isinstance(records, list):
        raise UsageError(f"{where} must be a list of timed steps")
    out = []
    for i, rec in enumerate(records):
        if (
            not isinstance(rec, dict)
            or "seconds" not in rec
            or not set(rec) - {"seconds", *STEP_NOTES} <= _SHAPE_FIELDS | {"max_context_tokens"}
        ):
            raise UsageError(
                f"{where}[{i}]: a step is StepShape's fields, 'seconds' and "
                "optionally 'max_context_tokens'"
            )
        kind = LongestShape if "max_context_tokens" in rec else StepShape
        try:
            shape = kind(
                **{
                    k: int(finite_number(v, f"{where}[{i}].{k}"))
                    for k, v in rec.items()
                    if k != "seconds" and k not in STEP_NOTES
                }
            )
        except TypeError as exc:
            raise UsageError(f"{where}[{i}]: {exc}") from None
        seconds = finite_number(rec["seconds"], f"{where}[{i}].seconds")
        if seconds <= 0:
            raise UsageError(f"{where}[{i}].seconds must be > 0")
        out.append(TimedStep(shape, seconds))
    return tuple(out)
