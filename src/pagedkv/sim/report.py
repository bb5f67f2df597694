"""The comparison table (rich) and the plots (matplotlib, imported only when plotting)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pagedkv.sim.simulator import RunResult


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.1f} s"


def _hits(s: dict[str, Any]) -> str:
    text = f"{s['prefix_hit_tokens']:,} = {_pct(s['prefix_hit_rate'])}"
    ideal = s.get("ideal_prefix_hit_tokens")
    if ideal:
        text += f" ({_pct(s['prefix_hit_tokens'] / ideal)} of ideal)"
    if s.get("partial_hit_tokens"):  # every admission's, re-admissions after preemption too
        text += f"; partial blocks {s['partial_hit_tokens']:,} (all admissions)"
    return text


def _preempt(s: dict[str, Any]) -> str:
    """Preemptions, and how many of them swapped when any did."""
    swaps = s.get("swap_outs", 0)
    return f"{s['preemptions']} ({swaps} swapped)" if swaps else str(s["preemptions"])


_COLUMNS = (
    "policy",
    "B",
    "pool tokens",
    "done",
    "refused",
    "peak run",
    "mean run",
    "KV used",
    "tail frag",
    "rsv unused",
    "cached",
    "prefix hit",
    "preempt",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "replay",
)


def comparison_table(summaries: Sequence[dict[str, Any]], title: str = "") -> Table:
    """One row per run (``summarize`` dicts). Pool shares are time means; "prefix hit" is
    reused prompt tokens, as a share of all prompt tokens and of what the trace allows."""
    table = Table(title=title or None, header_style="bold")
    for name in _COLUMNS:
        table.add_column(name, justify="left" if name == "policy" else "right")
    for s in summaries:
        table.add_row(
            s["policy"],
            str(s["block_size"]),
            f"{s['num_kv_slots']:,}",
            str(s["num_finished"]),
            str(s["refused"]),
            str(s["peak_running"]),
            f"{s['mean_running']:.1f}",
            _pct(s["kv_utilization_mean"]),
            _pct(s["fragmentation_mean"]),
            _pct(s["reserved_unused_mean"]),
            _pct(s["cached_mean"]),
            _hits(s),
            _preempt(s),
            f"{s['throughput_tokens_per_s']:,.0f}",
            _secs(s["ttft_p50_s"]),
            _secs(s["ttft_p99_s"]),
            _secs(s["tpot_p50_s"]),
            f"{s['wall_time_s']:.1f} s",
        )
    return table


def print_table(summaries: Sequence[dict[str, Any]], title: str, console: Console) -> None:
    """Print the table; a pipe or file gets a wide console instead of 80 columns."""
    if not console.is_terminal:
        console = Console(file=console.file, width=220)
    console.print(comparison_table(summaries, title))


_CLUSTER_COLUMNS = (
    "router",
    "policy",
    "replicas",
    "done",
    "refused",
    "prefix hit",
    "of ceiling",
    "TTFT p50",
    "TTFT p99",
    "out tok/s",
    "mean run",
    "imbalance",
    "preempt",
    "decisions",
    "replay",
)
_REPLICA_COLUMNS = (
    "replica",
    "routed",
    "done",
    "prefix hit",
    "TTFT p50",
    "TTFT p99",
    "out tok/s",
    "mean run",
    "peak run",
    "preempt",
)


def _table(columns: Sequence[str], title: str) -> Table:
    table = Table(title=title or None, header_style="bold")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def cluster_table(summaries: Sequence[dict[str, Any]], title: str = "") -> Table:
    """One row per cluster run (``summarize_cluster`` dicts): totals over every replica.
    "of ceiling": prefix-hit tokens / the hits of one engine holding every prefix forever;
    "imbalance": max / mean over replicas of time-mean running sequences."""
    table = _table(_CLUSTER_COLUMNS, title)
    for s in summaries:
        ideal = s["prefix_hit_of_ideal"]
        imbalance = s["load_imbalance"]
        table.add_row(
            s["router"],
            s["policy"],
            str(s["num_replicas"]),
            str(s["num_finished"]),
            str(s["refused"]),
            f"{s['prefix_hit_tokens']:,}",
            "-" if ideal is None else _pct(ideal),
            _secs(s["ttft_p50_s"]),
            _secs(s["ttft_p99_s"]),
            f"{s['throughput_tokens_per_s']:,.0f}",
            f"{s['mean_running']:.1f}",
            "-" if imbalance is None else f"{imbalance:.2f}",
            _preempt(s),
            " ".join(f"{k} {v}" for k, v in s["routing_decisions"].items()),
            f"{s['wall_time_s']:.1f} s",
        )
    return table


def replica_table(summary: dict[str, Any], title: str = "") -> Table:
    """One row per replica of one cluster run."""
    table = _table(_REPLICA_COLUMNS, title)
    for r in summary["replicas"]:
        table.add_row(
            r["replica"],
            str(r["num_requests"]),
            str(r["num_finished"]),
            f"{r['prefix_hit_tokens']:,}",
            _secs(r["ttft_p50_s"]),
            _secs(r["ttft_p99_s"]),
            f"{r['throughput_tokens_per_s']:,.0f}",
            f"{r['mean_running']:.1f}",
            str(r["peak_running"]),
            str(r["preemptions"]),
        )
    return table


def print_cluster_tables(summaries: Sequence[dict[str, Any]], title: str, console: Console) -> None:
    """The totals table, then one per-replica table per run."""
    if not console.is_terminal:
        console = Console(file=console.file, width=220)
    console.print(cluster_table(summaries, title))
    for s in summaries:
        name = f"{s['router']} / {s['policy']} ({s['num_kv_slots']:,} slots): per replica"
        console.print(replica_table(s, name))


def plot_runs(results: Sequence[RunResult], path: str | Path) -> None:
    """KV utilization and running sequences over time per run, and the mean waste split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kv, ax_run, ax_waste) = plt.subplots(3, 1, figsize=(10, 11))
    labels = [f"{r.policy.name} (B={r.block_size})" for r in results]
    for r, label in zip(results, labels, strict=True):
        ax_kv.plot(r.series.time_s, r.series.kv_utilization, label=label, linewidth=1)
        ax_run.plot(r.series.time_s, r.series.running, label=label, linewidth=1)
    ax_kv.set(title="KV utilization (used slots / pool)", xlabel="simulated time (s)")
    ax_run.set(title="running sequences", xlabel="simulated time (s)")
    ax_kv.legend(fontsize=8)
    ax_run.legend(fontsize=8)
    parts = (
        ("used", "kv_utilization"),
        ("tail fragmentation", "fragmentation_frac"),
        ("reserved unused", "reserved_unused_frac"),
        ("cached (evictable)", "cached_frac"),
    )
    bottoms = [0.0] * len(results)
    xs = range(len(results))
    for name, attr in parts:
        heights = [r.series.mean(attr) for r in results]
        ax_waste.bar(xs, heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax_waste.set_xticks(list(xs), labels, rotation=15, fontsize=8)
    ax_waste.set(title="mean share of the KV pool", ylabel="fraction of pool slots")
    ax_waste.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
