"""How a plan is shown: JSON for programs, a rich table for people, a plot for the README.

Rounding convention (stated once, used everywhere): ``*_bytes`` fields are exact byte counts
rounded to whole bytes; ``*_mb`` fields are 10^6 bytes and ``*_kib`` fields 1024 bytes, both
rounded to 2 decimals; rates are fractions in [0, 1] rounded to 6 decimals. The article's
"MB" is 10^6 bytes and its block-table "KB" is KiB; its totals add the KiB column as thousandths
of an MB, so they can differ from ``total_mb`` here by up to 0.01.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.planner import ledgers
from pagedkv.planner.plan import Plan, PlanRow

if TYPE_CHECKING:
    from rich.console import Console

JSON_SCHEMA_VERSION = 1


def _mb(num_bytes: float) -> float:
    return round(num_bytes / 1e6, 2)


def _kib(num_bytes: float) -> float:
    return round(num_bytes / 1024, 2)


def row_to_json(row: PlanRow, num_seqs: int) -> dict[str, Any]:
    """One block size's ledgers as JSON (see docs/planner.md for each field)."""
    return {
        "block_size": row.block_size,
        "block_bytes": row.block_bytes,
        "block_kib": _kib(row.block_bytes),
        "layer_block_bytes": row.layer_block_bytes,
        "table_entries": round(row.table_entries, 2),
        "table_bytes": row.table_bytes,
        "table_kib": _kib(row.table_bytes),
        "internal_fragmentation_slots_per_seq": round(
            row.internal_fragmentation_slots / num_seqs, 4
        ),
        "internal_fragmentation_slots": round(row.internal_fragmentation_slots, 2),
        "internal_fragmentation_bytes": round(row.internal_fragmentation_bytes),
        "internal_fragmentation_mb": _mb(row.internal_fragmentation_bytes),
        "prefix_reuse_tokens": round(row.prefix_reuse_tokens, 2),
        "prefix_lost_tokens": round(row.prefix_lost_tokens, 2),
        "prefix_reuse_rate": round(row.prefix_reuse_rate, 6),
        "prefix_waste_bytes": round(row.prefix_waste_bytes),
        "prefix_waste_mb": _mb(row.prefix_waste_bytes),
        "total_bytes": round(row.total_bytes),
        "total_mb": _mb(row.total_bytes),
        "kernel_block_iterations": row.kernel_block_iterations,
        "swap_transfers": row.swap_transfers,
        "paged_capacity_seqs": row.paged_capacity_seqs,
        "aligned": row.aligned,
        "int32_max_pool_blocks": row.int32_max_pool_blocks,
        "int32_max_pool_bytes": row.int32_max_pool_bytes,
        "prefix_shorter_than_block": row.prefix_shorter_than_block,
        "allowed": row.allowed,
        "violations": list(row.violations),
        "decode_step_ms": None if row.decode_step_s is None else row.decode_step_s * 1e3,
        "prefix_match_unit": row.prefix_match_unit,
        "prefix_copy_tokens": round(row.prefix_copy_tokens, 2),
        "prefix_copy_bytes": round(row.prefix_copy_bytes),
        "prefix_copy_us": None if row.prefix_copy_s is None else round(row.prefix_copy_s * 1e6, 3),
        "prefix_recompute_us": None
        if row.prefix_recompute_s is None
        else round(row.prefix_recompute_s * 1e6, 3),
    }


def plan_to_json(plan: Plan, resolution_log: str | None = None) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict (stable field names, ``schema_version`` 1)."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "clock": plan.clock_source,
        "prefix_match_unit": plan.prefix_match_unit,
        "model": _model_json(plan),
        "workload": _workload_json(plan),
        "backend": plan.backend,
        "alignment_bytes": plan.alignment_bytes,
        "swap_bytes": plan.swap_bytes,
        "rows": [row_to_json(r, plan.workload.num_seqs) for r in plan.rows],
        "capacity": _capacity_json(plan),
        "recommendation": {
            "block_size": plan.recommended_block_size,
            "reasons": list(plan.reasons),
            "warnings": list(plan.warnings),
            "resolution": resolution_log,
        },
    }


def _model_json(plan: Plan) -> dict[str, Any]:
    """The model's KV layout: its shape, record bytes and weights."""
    layout = plan.layout
    return {
        "name": layout.name,
        "attention": layout.attention,
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "kv_lora_rank": layout.kv_lora_rank,
        "qk_rope_head_dim": layout.qk_rope_head_dim,
        "kv_dtype": layout.kv_dtype,
        "layer_record_bytes": layout.layer_record_bytes,
        "record_bytes": layout.record_bytes,
        "num_params": layout.num_params,
        "weight_bytes": layout.weight_bytes,
    }


def _workload_json(plan: Plan) -> dict[str, Any]:
    """The workload's sequences and prefix hits (the prefixes' spread, None without any)."""
    workload = plan.workload
    prefixes = workload.prefix_lens_tokens
    return {
        "source": workload.source,
        "num_seqs": workload.num_seqs,
        "mean_len_tokens": round(workload.mean_len_tokens, 2),
        "max_len_tokens": workload.max_len_tokens,
        "num_prefix_hits": workload.num_prefix_hits,
        "prefix_len_tokens": None
        if not prefixes
        else {
            "count": len(prefixes),
            "total": sum(prefixes),
            "min": min(prefixes),
            "median": statistics.median(prefixes),
            "max": max(prefixes),
        },
    }


def _capacity_json(plan: Plan) -> dict[str, Any] | None:
    """What the pool holds when reserving max_len per sequence; None without a pool size."""
    if plan.pool_bytes is None:
        return None
    workload = plan.workload
    return {
        "pool_bytes": plan.pool_bytes,
        "max_len_tokens": workload.max_len_tokens,
        "mean_len_tokens": workload.mean_len_tokens,
        "reserved_capacity_seqs": plan.reserved_capacity_seqs,
        "reserved_waste_rate": round(
            ledgers.reserved_waste_rate(workload.mean_len_tokens, workload.max_len_tokens), 6
        ),
    }


@dataclass(frozen=True)
class _Columns:
    """The table's optional columns, each shown when the plan has its numbers."""

    capacity: bool  # paged sequences in the pool
    time: bool  # the decode step's time on a clock
    copy: bool  # partial-block reuse: bytes copied per hit, when not priced in time
    copy_time: bool  # ... its copy against recomputing it, in time

    @classmethod
    def of(cls, plan: Plan) -> _Columns:
        """The columns ``plan``'s numbers fill."""
        copy_time = any(r.prefix_copy_s is not None for r in plan.rows)
        return cls(
            capacity=plan.pool_bytes is not None,
            time=any(r.decode_step_s is not None for r in plan.rows),
            copy=plan.prefix_match_unit is not None and not copy_time,
            copy_time=copy_time,
        )

    def headers(self) -> list[str]:
        """Every column's header, ``allowed`` last."""
        headers = ["B", "block\nKiB", "table\nentries", "table\nKiB", "frag\nslots/seq"]
        headers += ["frag\nMB", "prefix\nreuse", "prefix\nMB", "W(B)\nMB", "kernel\niters"]
        headers += ["swap\nxfers"] + (["paged\nseqs"] if self.capacity else [])
        headers += ["decode\nstep ms"] if self.time else []
        headers += ["copy/hit\nKiB"] if self.copy else []
        headers += ["copy/recomp\nus per hit"] if self.copy_time else []
        return [*headers, "allowed"]

    def cells(self, row: PlanRow, num_seqs: int) -> list[str]:
        """One block size's cells, in the order of ``headers``."""
        cells = [
            str(row.block_size),
            f"{row.block_bytes / 1024:.6g}",
            f"{row.table_entries:.0f}",
            f"{row.table_bytes / 1024:.6g}",
            f"{row.internal_fragmentation_slots / num_seqs:.2f}",
            f"{row.internal_fragmentation_bytes / 1e6:.2f}",
            f"{100 * row.prefix_reuse_rate:.1f}%",
            f"{row.prefix_waste_bytes / 1e6:.2f}",
            f"{row.total_bytes / 1e6:.2f}",
            str(row.kernel_block_iterations),
            str(row.swap_transfers),
        ]
        cells += [str(row.paged_capacity_seqs)] if self.capacity else []
        if self.time:
            cells.append("" if row.decode_step_s is None else f"{row.decode_step_s * 1e3:.2f}")
        if self.copy:
            cells.append(f"{row.prefix_copy_bytes / 1024:.1f}")
        if self.copy_time:
            copy_s, recompute_s = row.prefix_copy_s, row.prefix_recompute_s
            if copy_s is None or recompute_s is None:
                cells.append("")
            else:
                cells.append(f"{copy_s * 1e6:.0f}/{recompute_s * 1e6:.0f}")
        cells.append("yes" if row.allowed else "[red]no[/]")
        return cells


def render_plan(plan: Plan, console: Console, resolution_log: str | None = None) -> None:
    """Print the plan to a ``rich.console.Console``: summary, one table row per B, verdict."""
    from rich.table import Table

    layout, workload = plan.layout, plan.workload
    unit = plan.prefix_match_unit
    console.print(
        f"[bold]{layout.name}[/]: {layout.record_bytes} B/token KV ({layout.kv_dtype}, "
        f"{layout.num_layers} layer(s) x {layout.layer_record_bytes} B); workload "
        f"K={workload.num_seqs}, mean {workload.mean_len_tokens:g}, max "
        f"{workload.max_len_tokens} tokens, H={workload.num_prefix_hits}; backend {plan.backend}"
        + (f"; prefix match unit {unit} (partial blocks reused)" if unit is not None else "")
    )
    table = Table(title="What each block size costs (MB = 10^6 B, KiB = 1024 B)")
    columns = _Columns.of(plan)
    for header in columns.headers():
        table.add_column(header, justify="right")
    for row in plan.rows:
        style = "bold green" if row.block_size == plan.recommended_block_size else None
        table.add_row(*columns.cells(row, workload.num_seqs), style=style)
    console.print(table)
    if columns.time and plan.clock_source:
        console.print(f"decode step ms: {plan.clock_source}", soft_wrap=True)
    _render_verdict(plan, console, resolution_log)


def _render_verdict(plan: Plan, console: Console, resolution_log: str | None) -> None:
    """What reserving would fit in the pool, the recommended block size and why."""
    workload = plan.workload
    if plan.pool_bytes is not None:  # the capacity column's, spelled so that the type narrows
        waste = ledgers.reserved_waste_rate(workload.mean_len_tokens, workload.max_len_tokens)
        console.print(
            f"capacity: KV pool {plan.pool_bytes / 2**30:.2f} GiB -> reserving max_len fits "
            f"{plan.reserved_capacity_seqs} sequences ({100 * waste:.0f}% of each reservation "
            f"unused); paged: see 'paged seqs'"
        )
    console.print(f"[bold]recommended block size: {plan.recommended_block_size}[/]")
    for reason in plan.reasons:
        console.print(f"  - {reason}")
    for warning in plan.warnings:
        console.print(f"  [yellow]warning:[/] {warning}")
    if resolution_log:
        console.print(f"  resolved: {resolution_log}")
