"""The routing figure: per router vs the number of replicas, prefix-hit tokens against the
one-engine ceiling, TTFT p50 and p99, and load imbalance (matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_PANELS = (
    ("prefix_hit_tokens", "prefix-hit tokens (millions)", 1e-6, False),
    ("ttft_p50_s", "TTFT p50 (s)", 1.0, True),
    ("ttft_p99_s", "TTFT p99 (s)", 1.0, True),
    ("load_imbalance", "load imbalance (max / mean time-mean running)", 1.0, False),
)


def plot_routing(result: dict[str, Any], png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["points"]
    routers = list(dict.fromkeys(r["router"] for r in rows))
    counts = sorted({r["num_replicas"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for ax, (key, label, scale, log_y) in zip(axes.flat, _PANELS, strict=True):
        for router in routers:
            pts = sorted(
                (r["num_replicas"], r[key] * scale)
                for r in rows
                if r["router"] == router and r[key] is not None
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=router)
        if key == "prefix_hit_tokens":
            ceiling = sorted(
                (r["num_replicas"], r["ideal_prefix_hit_tokens"] * scale) for r in rows
            )
            ax.plot(
                *zip(*ceiling, strict=True),
                "k--",
                linewidth=1,
                label="ceiling (one engine, infinite cache)",
            )
            ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        if log_y:
            ax.set_yscale("log")
        ax.set(xlabel="replicas (arrival rate x N / 2)", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    setup = result["setup"]
    quick = " (quick: first requests only)" if result.get("quick") else ""
    fig.suptitle(
        f"routing over replicas: {setup['trace']}, {setup['model']} on {setup['gpu']} "
        f"({setup['policy']} policy, simulated){quick}"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
