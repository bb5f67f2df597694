"""The block-size figure: normalized latency vs request rate per block size, a panel per workload
(matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_block_size(result: dict[str, Any], png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["points"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    block_sizes = sorted({r["block_size"] for r in rows})
    cmap = plt.get_cmap("viridis")
    shared = result.get("partial_reuse", {}).get("points", [])
    panels = len(workloads) + (1 if shared else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.6), squeeze=False)
    if shared:
        _plot_partial(axes[0][-1], shared, result["setup"])
    for ax, workload in zip(axes[0], workloads, strict=False):
        for i, b in enumerate(block_sizes):
            pts = sorted(
                (r["rate_per_s"], r["normalized_latency_s_per_token"])
                for r in rows
                if r["workload"] == workload and r["block_size"] == b
            )
            color = cmap(i / max(1, len(block_sizes) - 1))
            ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=f"B={b}")
        ax.set_yscale("log")
        ax.set_title(f"{workload} ({result['setup']['model']}, {result['setup']['gpu']})")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][len(workloads) - 1].legend(fontsize=8, ncol=2)
    fig.suptitle(
        "block size vs normalized latency (simulated: fitted A100 clock, paged vLLM kernel)"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def _plot_partial(ax: Any, rows: list[dict[str, Any]], setup: dict[str, Any]) -> None:
    """Prefix-hit share of the prompt tokens vs B: whole blocks (dashed) and U = 1 (solid),
    one color per rate; normalized latency in the legend's reach as the right axis."""
    import matplotlib.pyplot as plt

    rates = sorted({r["rate_per_s"] for r in rows})
    colors = plt.get_cmap("tab10")
    for i, rate in enumerate(rates):
        for unit, style in ((None, "--"), (1, "-")):
            pts = sorted(
                (r["block_size"], 100 * r["prefix_hit_tokens"] / max(1, r["prompt_tokens"]))
                for r in rows
                if r["rate_per_s"] == rate and r["prefix_match_unit"] == unit
            )
            label = f"{rate:g} req/s, " + ("whole blocks" if unit is None else "U = 1")
            ax.plot(*zip(*pts, strict=True), style, marker="o", color=colors(i), label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("prefix-hit tokens (% of prompt tokens)")
    ax.set_title(f"shared system prompts: partial-block reuse ({setup['model']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
