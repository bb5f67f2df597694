"""`pagedkv experiment NAME`: run one of the papers' sweeps, write its JSON and its figure.

Each experiment is a module of ``pagedkv.sim.experiments`` with ``DESCRIPTION``,
``run(*, quick, workers, progress) -> dict`` (every point, JSON-ready) and
``plot(result, png_path)``; it is imported only when it runs, so one missing module costs only
its own name. Output: ``DIR/experiments/NAME.json`` and ``DIR/img/NAME.png``, DIR = results
by default (a scratch folder: the committed figures live under docs/, and rewriting a file git
tracks needs ``--force``, as regenerating them with ``--out docs --force`` does).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from pagedkv.commands.overwrite import add_force_flag, check_overwrite
from pagedkv.errors import UsageError

# name -> module under pagedkv.sim.experiments
EXPERIMENTS: dict[str, str] = {
    "block-size": "block_size",
    "preemption": "preemption",
    "routing": "routing",
}


def load_experiment(name: str) -> ModuleType:
    """The module of experiment ``name``; UsageError for an unknown name or a module that is
    not installed (named, never a traceback)."""
    if name not in EXPERIMENTS:
        raise UsageError(f"unknown experiment {name!r} (known: {', '.join(EXPERIMENTS)})")
    module_name = f"pagedkv.sim.experiments.{EXPERIMENTS[name]}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, "pagedkv.sim.experiments"):
            raise  # a missing dependency inside it is a bug, not the user's mistake
        raise UsageError(f"experiment {name!r} is not built ({module_name} is missing)") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "experiment",
        help="run a paper's sweep through the simulator; write its JSON and figure",
        description="Run one of the PagedAttention paper's experiments (or the routing sweep) "
        "through the simulator and write DIR/experiments/NAME.json (every point) and "
        "DIR/img/NAME.png. DIR is results/ unless --out; a file git tracks (the copies under "
        "docs/) is overwritten only with --force. Experiments: " + "; ".join(EXPERIMENTS),
    )
    p.add_argument("name", metavar="NAME", help=f"one of {', '.join(EXPERIMENTS)}")
    p.add_argument(
        "--out",
        default="results",
        metavar="DIR",
        help="output folder (results; the docs' own copies: --out docs --force)",
    )
    add_force_flag(p)
    p.add_argument("--quick", action="store_true", help="fewer requests per point (a smoke run)")
    p.add_argument("--workers", metavar="N", help="processes (default: every core)")
    p.add_argument(
        "--clock",
        choices=("vllm-class", "pagedkv-triton"),
        help="block-size only: "
        "the paper's setup on the vLLM-class reference clock (default), or pagedkv's "
        "own engine on its measured clock (writes NAME-pagedkv-triton.json/.png)",
    )
    p.set_defaults(func=run)


def _workers(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.strip().isdecimal() or int(text) < 1:
        raise UsageError(f"--workers must be a whole number >= 1, got {text!r}", "--workers")
    return int(text)


def run(a: argparse.Namespace) -> int:
    workers = _workers(a.workers)
    module = load_experiment(a.name)
    clock = getattr(a, "clock", None)
    if clock is not None and a.name != "block-size":
        raise UsageError("--clock: only the block-size experiment runs on either clock", "--clock")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("experiments write a figure: install matplotlib (pagedkv[plot])")
    out = Path(a.out)
    stem = a.name if clock in (None, "vllm-class") else f"{a.name}-{clock}"
    json_path = out / "experiments" / f"{stem}.json"
    png_path = out / "img" / f"{stem}.png"
    for path in (json_path, png_path):  # before the sweep's minutes, not after
        check_overwrite(path, "--out", a.force)
    for folder in (json_path.parent, png_path.parent):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out: cannot create {str(folder)!r}: {exc}", "--out") from None

    def progress(done: int, total: int) -> None:  # a live counter on a terminal only
        print(f"\r{a.name}: {done}/{total} points", end="", file=sys.stderr, flush=True)

    description = module.DESCRIPTION
    if clock == "pagedkv-triton":
        description = module.DESCRIPTION_PAGEDKV
    print(f"{a.name}: {description}", file=sys.stderr)
    live = sys.stderr.isatty()
    extra = {"clock": clock} if clock is not None else {}
    result = module.run(
        quick=a.quick, workers=workers, progress=progress if live else None, **extra
    )
    if live:
        print(file=sys.stderr)
    json_path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    module.plot(result, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0
