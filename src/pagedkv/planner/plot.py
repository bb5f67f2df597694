"""The plan as a picture: the prefix-reuse sawtooth over B, and W(B) stacked by ledger.

matplotlib is imported inside ``save_plan_plot`` only: the planner must import without it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from pagedkv.planner import ledgers
from pagedkv.planner.plan import Plan


def save_plan_plot(plan: Plan, path: str | Path) -> Path:
    """Write a two-panel PNG for ``plan`` to ``path`` and return the path.

    Left: mean prefix reuse rate for every integer B up to the largest candidate (the sawtooth;
    flat at 100% when the workload has no shared prefix), candidates marked. Right: W(B) in MB
    (10^6 bytes) as stacked bars of fragmentation, block table and lost prefix.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    path = Path(path)
    rows = plan.rows
    prefixes = plan.workload.prefix_lens_tokens
    fig, (ax_reuse, ax_waste) = plt.subplots(1, 2, figsize=(11, 4.2))

    all_sizes = list(range(1, max(r.block_size for r in rows) + 1))
    mean_label = "mean over the P distribution" if len(set(prefixes)) > 1 else "one prefix"
    ax_reuse.plot(
        all_sizes,
        [100 * ledgers.mean_prefix_reuse_rate(prefixes, b) for b in all_sizes],
        color="tab:blue",
        linewidth=1.4,
        label=mean_label,
    )
    if len(set(prefixes)) > 1:
        # A distribution smooths the teeth out; show the sawtooth of its median prefix too.
        median = int(statistics.median(prefixes))
        ax_reuse.plot(
            all_sizes,
            [100 * ledgers.mean_prefix_reuse_rate([median], b) for b in all_sizes],
            color="tab:blue",
            linestyle="--",
            linewidth=0.9,
            alpha=0.7,
            label=f"P = {median} (median)",
        )
    unit = plan.prefix_match_unit
    if unit is not None:  # partial-block reuse: counted in units of U where U divides B
        sizes = [b for b in all_sizes if b <= unit or b % unit == 0]
        ax_reuse.plot(
            sizes,
            [100 * ledgers.mean_prefix_reuse_rate(prefixes, min(b, unit)) for b in sizes],
            color="tab:green",
            linewidth=1.4,
            label=f"prefix match unit {unit}",
        )
    ax_reuse.scatter(
        [r.block_size for r in rows],
        [100 * r.prefix_reuse_rate for r in rows],
        color="tab:red",
        zorder=3,
        label="candidates",
    )
    for r in rows:
        ax_reuse.annotate(
            f"{100 * r.prefix_reuse_rate:.1f}%",
            (r.block_size, 100 * r.prefix_reuse_rate),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
    ax_reuse.set_xlabel("block size B (tokens)")
    ax_reuse.set_ylabel("prefix reuse rate (%)")
    ax_reuse.set_title("Prefix reuse floor(P/B)*B / P")
    ax_reuse.set_ylim(0, 105)
    ax_reuse.grid(alpha=0.3)
    ax_reuse.legend(loc="lower left")

    labels = [str(r.block_size) for r in rows]
    frag = [r.internal_fragmentation_bytes / 1e6 for r in rows]
    table = [r.table_bytes / 1e6 for r in rows]
    prefix = [r.prefix_waste_bytes / 1e6 for r in rows]
    ax_waste.bar(labels, frag, label="internal fragmentation", color="tab:orange")
    ax_waste.bar(labels, table, bottom=frag, label="block table (int32)", color="tab:gray")
    bottoms = [f + t for f, t in zip(frag, table, strict=True)]
    ax_waste.bar(labels, prefix, bottom=bottoms, label="lost prefix", color="tab:purple")
    for i, r in enumerate(rows):
        marker = " *" if r.block_size == plan.recommended_block_size else ""
        marker += "" if r.allowed else " (not allowed)"
        ax_waste.annotate(
            f"{r.total_bytes / 1e6:.2f}{marker}",
            (i, r.total_bytes / 1e6),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=8,
        )
    ax_waste.set_xlabel("block size B (tokens)")
    ax_waste.set_ylabel("W(B) (MB = 10^6 bytes)")
    ax_waste.set_title(f"W(B) by ledger; * = recommended ({plan.backend})")
    ax_waste.legend(loc="upper left")
    ax_waste.grid(axis="y", alpha=0.3)

    fig.suptitle(
        f"{plan.layout.name}: c = {plan.layout.record_bytes} B/token, "
        f"K = {plan.workload.num_seqs}, L_max = {plan.workload.max_len_tokens}, "
        f"H = {plan.workload.num_prefix_hits}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
