"""`pagedkv simulate`: replay a trace through the real scheduler and allocators, per policy.

A thin edge: parse the flags into a ``SimulateConfig`` (``commands/simulate_flags.py``: every
bad value is one error line, exit 2), call ``sim.scenario_load.load_scenario(config).run()``
(the library's "simulate run"), and print a rich table (or JSON), optionally a plot.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.commands.plot_path import prepare_plot_path
from pagedkv.commands.simulate_flags import add_simulate_args, validate


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a trace through the real scheduler and allocators under each policy",
        description=(
            "Replay a request trace (or a synthetic workload) through pagedkv's own scheduler "
            "and KV allocators, with the model replaced by a cost model (by default a GPU clock fitted to "
            "measured kernel times), once per "
            "policy; compare concurrency, KV waste, prefix hits, preemptions and latency. "
            "Sizes: GB = 10^9 bytes, GiB = 2^30; token counts accept 32k = 32768."
        ),
    )
    add_simulate_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    config = validate(a)
    if a.plot:
        prepare_plot_path(a.plot, a.force)
    from rich.console import Console
    from rich.markup import escape

    from pagedkv.sim.report import plot_runs, print_table
    from pagedkv.sim.scenario_load import load_scenario
    from pagedkv.traces import skipped_lines_note

    scenario = load_scenario(config)
    if scenario.skipped:  # one bad record does not cost the replay of the others
        note = skipped_lines_note(scenario.skipped)
        print(f"pagedkv simulate: warning: {note}", file=sys.stderr)
    err = Console(stderr=True, soft_wrap=True)
    source, rest = scenario.describe().split(": ", 1)
    err.print(f"[bold]{escape(source)}[/]: {escape(rest)}")
    if config.is_cluster:
        return _run_cluster(a, scenario, err)
    with _progress(err) as progress:

        def track(policy, slots, num_requests):  # one bar per run
            task = progress.add_task(
                f"{policy.name} ({slots:,} slots)", total=num_requests, sim_s=0.0
            )
            return lambda done, sim_s: progress.update(task, completed=done, sim_s=sim_s)

        runs = scenario.run(track)
    summaries = [s for _, s in runs]
    if a.json:
        print(json.dumps(summaries, indent=2, allow_nan=False))
    else:
        print_table(summaries, f"pagedkv simulate: {scenario.source}", Console())
    if a.plot:
        plot_runs([r for r, _ in runs], a.plot)
        err.print(f"plot written to {escape(a.plot)}")
    return 0


def _progress(console):  # noqa: ANN001, ANN202 - rich types stay out of the import path
    """One progress bar per run, on a terminal only."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("t={task.fields[sim_s]:,.0f} s"),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def _run_cluster(a: argparse.Namespace, scenario, err) -> int:  # noqa: ANN001
    """``--replicas``/``--router``: one cluster run per pool, policy and router."""
    from rich.console import Console

    from pagedkv.sim.report import print_cluster_tables

    n = scenario.config.num_replicas
    with _progress(err) as progress:

        def track(policy, slots, num_requests, router):  # one bar per cluster run
            task = progress.add_task(
                f"{router} x {n} ({policy.name}, {slots:,} slots)", total=num_requests, sim_s=0.0
            )
            return lambda done, sim_s: progress.update(task, completed=done, sim_s=sim_s)

        runs = scenario.run_cluster(track)
    summaries = [s for _, s in runs]
    if a.json:
        print(json.dumps(summaries, indent=2, allow_nan=False))
    else:
        title = f"pagedkv simulate: {scenario.source}, {n} replicas"
        print_cluster_tables(summaries, title, Console())
    return 0
