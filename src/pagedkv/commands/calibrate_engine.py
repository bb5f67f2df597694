"""`pagedkv calibrate --from-gpu-check JSON -o FILE`: the clock of pagedkv's own engine from a
device check (``sim/pagedkv_triton/calibrate.py``), written as JSON, its fit and check printed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}" if value < 0 else f"{value:.1%}"


def run_from_gpu_check(args: argparse.Namespace, output: Path) -> int:
    from rich.console import Console
    from rich.table import Table

    from pagedkv.errors import UsageError
    from pagedkv.sim.pagedkv_triton.calibrate import calibrate_engine
    from pagedkv.sim.pagedkv_triton.clock import write_engine_clock

    if args.spec or args.base:
        raise UsageError("--spec and --base go with --data; --from-gpu-check takes --gpu")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        result = calibrate_engine(args.from_gpu_check, args.gpu, args.trace, progress)
    except ImportError as exc:
        raise UsageError(f"calibrate needs numpy and scipy ({exc}): pip install scipy") from None
    clock, meta = result.clock, result.meta
    write_engine_clock(output, clock, meta)
    console = Console(width=132) if not Console().is_terminal else Console()
    laws = Table(
        title=f"decode attention on {clock.gpu}: the law in B the ledger chooses "
        "(|predicted / measured - 1|)"
    )
    for col in ("law", "median", "p90", "max", "leave-one-context-out median", "p90 "):
        laws.add_column(col, justify="left" if col == "law" else "right")
    for s in meta["decode_laws"]:
        mark = " (chosen)" if s["law"] == clock.decode_law else ""
        errs = ("median_err", "p90_err", "max_err", "loco_median_err", "loco_p90_err")
        laws.add_row(s["law"] + mark, *(_pct(s[e]) for e in errs))
    console.print(laws)
    steps = Table(title="timed steps on the clock (|predicted / measured - 1|)")
    for col in ("steps", "kind", "count", "median", "max"):
        steps.add_column(col, justify="left" if col in ("steps", "kind") else "right")
    for mode, report in meta["steps"].items():
        for kind, r in report.items():
            if kind != "sum_rel_err":
                steps.add_row(
                    mode, kind, str(r["steps"]), _pct(r["median_rel_err"]), _pct(r["max_rel_err"])
                )
        steps.add_row(mode, "sum of all", "", _pct(report["sum_rel_err"]), "")
    console.print(steps)
    runs = meta["runs"]
    if "skipped" in runs:
        console.print(f"engine runs not replayed: {runs['skipped']}")
    else:
        table = Table(title="the check's engine runs replayed on the clock")
        for col in ("run", "measured s", "predicted s", "error", "steps engine / sim"):
            table.add_column(col, justify="left" if col == "run" else "right")
        for mode, r in runs.items():
            steps = f"{r['steps']['engine']} / {r['steps']['simulator']}"
            table.add_row(
                mode, f"{r['measured_s']:.2f}", f"{r['predicted_s']:.2f}", _pct(r["rel_err"]), steps
            )
        console.print(table)
    for part, source in clock.sources.items():
        console.print(f"{part}: {source}", soft_wrap=True)
    print(f"wrote {output}")
    return 0
