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
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
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
    axes[0][-1].legend(fontsize=8, ncol=2)
    fig.suptitle(
        "block size vs normalized latency (simulated: fitted A100 clock, paged vLLM kernel)"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
