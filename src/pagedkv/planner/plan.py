"""One plan: every ledger for every candidate block size, hard constraints, a recommendation.

``build_plan`` is the planner's story: for each B it prices the four ledgers for the workload,
checks the backend's hard constraints, and recommends the allowed B with the least W(B),
stating the time ledger (kernel loop iterations) beside it, since W(B) counts bytes only.
Given a clock (``decode_step_s``: B -> seconds of one decode step of the workload's K
sequences at their mean length, which ``pagedkv plan --gpu`` takes from the simulator's fitted
GPU clock; the planner itself knows no GPU), each row carries that time too, and the
recommendation is the least W(B) among the allowed B whose decode step is within
``TIME_TOLERANCE`` of the fastest allowed one: memory and time from one model.

With a prefix-match unit U (``prefix_match_unit``; partial-block reuse, ``kvcache/partial.py``)
the prefix ledger counts in units of U at every B that U divides (B <= U: whole blocks), so
the lost prefix flattens for large B; the tokens reused out of a partially matched block are a
copy, priced per hit beside recomputing them when clocks are given (``copy_s``,
``recompute_s``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedkv.errors import UsageError
from pagedkv.pages.layout import KVLayout, int32_max_pool_blocks, is_aligned
from pagedkv.planner import ledgers
from pagedkv.planner.constraints import constraint_violations, get_backend
from pagedkv.planner.partial_reuse import copy_reason, unit_at
from pagedkv.planner.workload import Workload

DEFAULT_BLOCK_SIZES: tuple[int, ...] = (1, 8, 16, 32, 64, 128)
DEFAULT_SWAP_BYTES = 2**30  # the article's example: evicting 1 GiB of KV
DEFAULT_ALIGNMENT_BYTES = 128  # reported per row; a hard constraint only where a backend says
TIME_TOLERANCE = 0.05  # a decode step this much slower than the fastest allowed B is a cost


@dataclass(frozen=True)
class PlanRow:
    """Every ledger of one block size (bytes are exact; rounding happens when printed)."""

    block_size: int
    block_bytes: int
    layer_block_bytes: int
    table_entries: float
    table_bytes: int
    internal_fragmentation_slots: float
    internal_fragmentation_bytes: float
    prefix_reuse_tokens: float
    prefix_lost_tokens: float
    prefix_reuse_rate: float
    prefix_waste_bytes: float
    total_bytes: float
    kernel_block_iterations: int
    swap_transfers: int
    aligned: bool
    int32_max_pool_blocks: int
    int32_max_pool_bytes: int
    paged_capacity_seqs: int | None
    prefix_shorter_than_block: bool
    allowed: bool
    violations: tuple[str, ...] = ()
    decode_step_s: float | None = None  # one decode step of K sequences at the mean length
    # Partial-block reuse (module docstring): the unit at this B (None: whole blocks), the
    # tokens per hit reused out of a partially matched block and their bytes; with clocks, the
    # seconds per hit to copy them and to recompute them instead (at the median prefix).
    prefix_match_unit: int | None = None
    prefix_copy_tokens: float = 0.0
    prefix_copy_bytes: float = 0.0
    prefix_copy_s: float | None = None
    prefix_recompute_s: float | None = None


@dataclass(frozen=True)
class Plan:
    """The whole answer: inputs, one row per block size, capacity and the recommendation."""

    layout: KVLayout
    workload: Workload
    backend: str
    rows: tuple[PlanRow, ...]
    pool_bytes: int | None
    swap_bytes: int
    alignment_bytes: int
    recommended_block_size: int | None
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    clock_source: str | None = None  # what priced ``decode_step_s`` (None: no clock)
    prefix_match_unit: int | None = None  # None: whole blocks

    @property
    def reserved_capacity_seqs(self) -> int | None:
        """Sequences that fit if each reserves ``max_len`` (None without a memory budget)."""
        if self.pool_bytes is None:
            return None
        return ledgers.reserved_capacity_seqs(
            self.pool_bytes, self.layout.record_bytes, self.workload.max_len_tokens
        )


def _median_prefix(workload: Workload) -> float | None:
    return statistics.median(workload.prefix_lens_tokens) if workload.prefix_lens_tokens else None


def _price_row(
    block_size: int,
    layout: KVLayout,
    workload: Workload,
    pool_bytes: int | None,
    swap_bytes: int,
    alignment_bytes: int,
    backend: str,
    prefix_match_unit: int | None = None,
) -> PlanRow:
    c, k, b = layout.record_bytes, workload.num_seqs, block_size
    u = unit_at(b, prefix_match_unit)
    lens = workload.seq_lens_tokens
    if lens is None:
        entries = ledgers.expected_table_entries(k, workload.mean_len_tokens, b)
        frag_slots = ledgers.expected_fragmentation_slots(k, b)
    else:  # a trace sample: exact ledgers over it, scaled to K live sequences
        scale = k / len(lens)
        entries = ledgers.exact_table_entries(lens, b) * scale
        frag_slots = ledgers.exact_fragmentation_slots(lens, b) * scale
    prefixes = workload.prefix_lens_tokens
    lost = ledgers.mean_prefix_lost_tokens(prefixes, u)  # u = b without partial reuse
    reused = ledgers.mean_prefix_reuse_tokens(prefixes, u)
    copied = ledgers.mean_prefix_copy_tokens(prefixes, b, u)
    table_bytes = ledgers.padded_table_bytes(k, workload.max_len_tokens, b)
    prefix_waste_bytes = c * lost * workload.num_prefix_hits
    frag_bytes = c * frag_slots
    layer_block_bytes = layout.layer_block_bytes(b)
    max_pool_blocks = int32_max_pool_blocks(layer_block_bytes)
    num_blocks = None if pool_bytes is None else pool_bytes // layout.block_bytes(b)
    violations = constraint_violations(b, get_backend(backend), layout, num_blocks)
    median_prefix = _median_prefix(workload)
    return PlanRow(
        block_size=b,
        block_bytes=layout.block_bytes(b),
        layer_block_bytes=layer_block_bytes,
        table_entries=entries,
        table_bytes=table_bytes,
        internal_fragmentation_slots=frag_slots,
        internal_fragmentation_bytes=frag_bytes,
        prefix_reuse_tokens=reused,
        prefix_lost_tokens=lost,
        prefix_reuse_rate=ledgers.mean_prefix_reuse_rate(prefixes, u),
        prefix_waste_bytes=prefix_waste_bytes,
        total_bytes=frag_bytes + table_bytes + prefix_waste_bytes,
        kernel_block_iterations=ledgers.kernel_block_iterations(workload.mean_len_tokens, b),
        swap_transfers=ledgers.swap_transfers(swap_bytes, layout.block_bytes(b)),
        aligned=is_aligned(layer_block_bytes, alignment_bytes),
        int32_max_pool_blocks=max_pool_blocks,
        int32_max_pool_bytes=max_pool_blocks * layout.block_bytes(b),
        paged_capacity_seqs=None
        if pool_bytes is None
        else ledgers.paged_capacity_seqs(pool_bytes, c, workload.mean_len_tokens, b),
        prefix_shorter_than_block=median_prefix is not None and 0 < median_prefix < b,
        allowed=not violations,
        violations=tuple(violations),
        prefix_match_unit=None if u == b else u,
        prefix_copy_tokens=copied,
        prefix_copy_bytes=c * copied,
    )


def build_plan(
    layout: KVLayout,
    workload: Workload,
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES,
    backend: str = "torch-sdpa",
    pool_bytes: int | None = None,
    swap_bytes: int = DEFAULT_SWAP_BYTES,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    decode_step_s: Callable[[int], float] | None = None,
    clock_source: str | None = None,
    prefix_match_unit: int | None = None,
    copy_s: Callable[[float], float] | None = None,
    recompute_s: Callable[[int, float], float] | None = None,
) -> Plan:
    """Price every candidate block size and recommend one (ValueError on bad candidates);
    ``decode_step_s`` prices the time ledger (module docstring), ``clock_source`` names it.
    ``prefix_match_unit``: partial-block reuse; ``copy_s(bytes)`` and ``recompute_s(B,
    tokens)`` then price a hit's copy against recomputing the same tokens."""
    if not block_sizes:
        raise UsageError("give at least one candidate block size")
    if any(b < 1 for b in block_sizes):
        raise UsageError(f"block sizes must be >= 1 token, got {list(block_sizes)}")
    if pool_bytes is not None and pool_bytes < 1:
        raise UsageError(f"the KV pool must be > 0 bytes, got {pool_bytes}")
    get_backend(backend)  # unknown backend: fail before pricing anything
    if prefix_match_unit is not None and prefix_match_unit < 1:
        raise UsageError(f"--prefix-match-unit must be >= 1, got {prefix_match_unit}")
    sizes = sorted(set(block_sizes))
    costs = (layout, workload, pool_bytes, swap_bytes, alignment_bytes, backend)
    rows = tuple(_price_row(b, *costs, prefix_match_unit) for b in sizes)
    if decode_step_s is not None:
        rows = tuple(replace(r, decode_step_s=decode_step_s(r.block_size)) for r in rows)
    if copy_s is not None and recompute_s is not None and prefix_match_unit is not None:
        rows = tuple(_price_copy(r, copy_s, recompute_s) for r in rows)
    chosen, reasons, warnings = _recommend(rows, workload, backend)
    best = next((r for r in rows if r.block_size == chosen), None)
    if prefix_match_unit is not None and best is not None and best.prefix_match_unit:
        copied = (best.prefix_copy_tokens, best.prefix_copy_bytes)
        times = (best.prefix_copy_s, best.prefix_recompute_s)
        reasons.append(copy_reason(prefix_match_unit, *copied, *times))
    return Plan(
        layout,
        workload,
        backend,
        rows,
        pool_bytes,
        swap_bytes,
        alignment_bytes,
        chosen,
        tuple(reasons),
        tuple(warnings),
        clock_source,
        prefix_match_unit,
    )


def _price_copy(
    row: PlanRow, copy_s: Callable[[float], float], recompute_s: Callable[[int, float], float]
) -> PlanRow:
    """``row`` with the seconds per hit to copy its partial-block tokens and to recompute
    them instead; unchanged when a hit copies nothing there."""
    if not row.prefix_copy_tokens:
        return row
    return replace(
        row,
        prefix_copy_s=copy_s(row.prefix_copy_bytes),
        prefix_recompute_s=recompute_s(row.block_size, row.prefix_copy_tokens),
    )


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:.2f} MB"


def _recommend(
    rows: tuple[PlanRow, ...], workload: Workload, backend: str
) -> tuple[int | None, list[str], list[str]]:
    """Least W(B) among allowed rows; ties go to the larger B (fewer kernel iterations)."""
    allowed = [r for r in rows if r.allowed]
    excluded = [f"B={r.block_size} ({'; '.join(r.violations)})" for r in rows if not r.allowed]
    if not allowed:
        return None, [f"no candidate is allowed by backend {backend}: " + ", ".join(excluded)], []
    timed = [r.decode_step_s for r in allowed if r.decode_step_s is not None]
    slow: list[PlanRow] = []
    if len(timed) == len(allowed):  # weigh time: drop the B whose decode step costs more
        limit = min(timed) * (1 + TIME_TOLERANCE)
        slow = [r for r in allowed if r.decode_step_s is not None and r.decode_step_s > limit]
        allowed = [r for r in allowed if r not in slow]
    best = min(allowed, key=lambda r: (r.total_bytes, -r.block_size))
    reasons = [
        f"B={best.block_size} has the least memory waste W(B) = {_mb(best.total_bytes)} "
        f"(fragmentation {_mb(best.internal_fragmentation_bytes)} + block table "
        f"{best.table_bytes / 1024:.0f} KiB + lost prefix {_mb(best.prefix_waste_bytes)})"
    ]
    runner_up = [r for r in allowed if r is not best]
    if runner_up:
        second = min(runner_up, key=lambda r: (r.total_bytes, -r.block_size))
        reasons.append(
            f"next: B={second.block_size} at {_mb(second.total_bytes)} "
            f"(+{_mb(second.total_bytes - best.total_bytes)})"
        )
    spec = get_backend(backend)
    if excluded:
        reasons.append("excluded by hard constraints: " + ", ".join(excluded))
    elif spec.kernel_problems is not None:
        reasons.append(f"no block size excluded by backend {backend}: {spec.note}")
    if slow:
        fastest = min(r.decode_step_s or 0.0 for r in allowed)
        reasons.append(
            f"left out for time (decode step > {1 + TIME_TOLERANCE:.2f}x the fastest, "
            f"{fastest * 1e3:.2f} ms): "
            + ", ".join(f"B={r.block_size} ({(r.decode_step_s or 0) * 1e3:.2f} ms)" for r in slow)
        )
    larger = [r for r in allowed if r.block_size > best.block_size]
    time_note = (
        f"time ledger (not in W): a decode step loops over ceil(L/B) = "
        f"{best.kernel_block_iterations} blocks per sequence at B={best.block_size}"
    )
    if larger:
        time_note += f", {larger[0].kernel_block_iterations} at B={larger[0].block_size}"
    if spec.loops_over_tiles:  # the block count is no loop count of these kernels
        time_note = "time ledger (not in W): the kernels loop over tiles of the context, not blocks"
    if best.decode_step_s is not None:
        time_note += f"; one decode step of all K: {best.decode_step_s * 1e3:.2f} ms"
    reasons.append(time_note)
    warnings = []
    median_prefix = _median_prefix(workload)
    if best.prefix_shorter_than_block and median_prefix is not None:
        warnings.append(
            f"typical shared prefix ({median_prefix:g} tokens, median) is shorter than one "
            f"block of {best.block_size}: it can never hit"
        )
    return best.block_size, reasons, warnings
