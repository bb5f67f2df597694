"""`pagedkv calibrate`: fit a GPU's step clock to measured op times and write it as JSON.

    pagedkv calibrate --data ../shared/data/gpu_profiles --data data/gpu_profiles \\
        --gpu a100 -o a100-clock.json

reads every profile file under each --data folder laid out as Vidur's published profiles
(compute/<gpu>/<org>/<model>/mlp.csv, <gpu>/mlp*.csv, <gpu>/attention*.csv,
<gpu>/cpu_overheads.csv; times in ms), keeps the rows of GPU folder --gpu, and fits the clock's
physical parameters (sim/vllm_class/clock.py: achieved bandwidth and compute of the GEMMs and their
knee, each elementwise kernel's bandwidth and launch cost, the attention kernel's tile walk,
split and launch costs, a step's CPU overhead) family by family. A family without rows keeps
the --base clock's numbers (default: the clock pagedkv ships for that GPU's architecture) and
the file says so. `pagedkv simulate --clock FILE` prices steps with the result; the shipped
presets (src/pagedkv/presets/clocks/) are this command's output on the data named in them.
Needs numpy and scipy (pip install 'pagedkv[calibrate]').

    pagedkv calibrate --from-gpu-check results/gpu_check.json -o h200-pagedkv.json

fits instead a clock of pagedkv's own engine on the GPU a device check ran on
(benchmarks/gpu_check.py; docs/gpu_clock.md "pagedkv's own clock"): decode attention per
(B, context, batch) from the ledger rows, the law in B chosen by leave-one-context-out
cross-validation (each law's residuals printed); the prefill kernel (a mixed step's decode rows
included), the other kernels and the host cost eager and with CUDA graphs from the timed steps
(the cost profile beside the JSON, the clock section's steps); GEMMs borrowed from the GPU's
vLLM-class clock. The file says which parts were fitted on what and which were borrowed; the
check's own engine runs are replayed on the result and their errors printed (the workload's
trace: --trace, else the shared one). `pagedkv simulate --clock FILE` and `experiment
block-size --clock FILE` price pagedkv's kernels with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator is imported when the command runs
    from pagedkv.sim.gpus import GPUSpec
    from pagedkv.sim.vllm_class.clock import GPUClock
    from pagedkv.sim.vllm_class.data import OpRow


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit a GPU step clock to measured op times (Vidur-format CSVs); write JSON",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--data",
        action="append",
        metavar="DIR",
        help="a Vidur-format profile folder (repeat): the vLLM-class clock",
    )
    source.add_argument(
        "--from-gpu-check",
        metavar="JSON",
        help="a device check's JSON: the clock of pagedkv's own engine",
    )
    add(
        "--gpu",
        help="with --data: the GPU folder to fit, e.g. a100 or h100; with "
        "--from-gpu-check: the GPU preset (default: the check's device)",
    )
    add(
        "--trace",
        metavar="FILE",
        help="--from-gpu-check: the engine section's trace (default: the shared one it names)",
    )
    add("--spec", help="the GPU preset its rates come from (default: the folder's alias)")
    add("--base", metavar="FILE", help="clock JSON whose numbers unfitted families keep")
    add("-o", "--output", required=True, help="clock JSON to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv.errors import UsageError

    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():
        raise UsageError(f"--output {str(output)!r}: not a file in an existing folder")
    if args.from_gpu_check is not None:
        from pagedkv.commands.calibrate_engine import run_from_gpu_check

        return run_from_gpu_check(args, output)
    return _run_vllm_class(args, output)


def _run_vllm_class(args: argparse.Namespace, output: Path) -> int:
    """``--data``: fit the vLLM-class clock of the ``--gpu`` folder's rows, write it to
    ``output`` with what was fitted on what and what was borrowed, print each family's errors."""
    from pagedkv.errors import UsageError
    from pagedkv.sim.clock_presets import VLLM_CLASS
    from pagedkv.sim.gpus import get_gpu
    from pagedkv.sim.vllm_class.data import FAMILIES, read_rows
    from pagedkv.sim.vllm_class.fit import fit_clock, write_clock

    if args.gpu is None:
        raise UsageError("--data needs --gpu (the GPU folder to fit, e.g. a100 or h100)")
    gpu = get_gpu(args.spec or args.gpu)
    rows = [r for d in args.data for r in read_rows(d) if r.gpu == args.gpu]
    if not rows:
        raise UsageError(f"--gpu {args.gpu!r}: no rows of that GPU folder under {args.data}")
    base, base_source = _base_clock(args, gpu)
    try:
        clock, sigmas = fit_clock(
            rows, gpu, base, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
    except ImportError as exc:
        raise UsageError(f"calibrate needs numpy and scipy ({exc}): pip install scipy") from None
    families = _family_errors(rows, clock, gpu)
    borrowed = {f: base_source for f in FAMILIES if f not in families}
    meta = {
        "describes": VLLM_CLASS,
        "fitted_on": sorted({r.file for r in rows}),
        "gpu_folder": args.gpu,
        "families": families,
        "borrowed": borrowed,
        "rel_sigma": sigmas,
    }
    write_clock(output, clock, gpu, meta)
    _print_fit(f"clock of {gpu.name} fitted on {len(rows):,} rows ({args.gpu})", meta)
    print(f"wrote {output}")
    return 0


def _base_clock(args: argparse.Namespace, gpu: GPUSpec) -> tuple[GPUClock, str]:
    """(the clock whose numbers unfitted families keep, where it came from): ``--base``, else
    the clock shipped for ``gpu``, else pagedkv's starting values."""
    from pagedkv.errors import UsageError
    from pagedkv.sim.clock_presets import clock_for
    from pagedkv.sim.vllm_class.fit import read_clock

    if args.base:
        base, base_meta = read_clock(args.base)
        return base, f"{args.base} ({base_meta.get('gpu', '?')})"
    try:
        return clock_for(gpu)
    except UsageError:
        from pagedkv.sim.vllm_class.clock import GPUClock

        return GPUClock(), "pagedkv's starting values (not fitted)"


def _family_errors(rows: list[OpRow], clock: GPUClock, gpu: GPUSpec) -> dict:
    """Per family with rows: the fitted clock's relative errors on them, and their files."""
    from pagedkv.sim.vllm_class.data import FAMILIES
    from pagedkv.sim.vllm_class.fit import errors, summarize_errors

    families = {}
    for family in FAMILIES:
        mine = [r for r in rows if r.family == family]
        if mine:
            families[family] = {
                **summarize_errors(errors(mine, clock, gpu)),
                "files": sorted({r.file for r in mine}),
            }
    return families


def _print_fit(title: str, meta: dict) -> None:
    """One row per family: its fit's errors, or the clock it was kept from."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("family", "rows", "median |err|", "p95", "max"):
        table.add_column(col, justify="left" if col == "family" else "right")
    for family, s in meta["families"].items():
        table.add_row(
            family,
            f"{s['rows']:,}",
            f"{s['median_rel_err']:.1%}",
            f"{s['p95_rel_err']:.1%}",
            f"{s['max_rel_err']:.1%}",
        )
    for family, source in meta["borrowed"].items():
        table.add_row(family, "0", f"kept from {source}", "", "")
    Console().print(table)
