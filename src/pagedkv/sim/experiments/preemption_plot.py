"""The figure of the preemption experiment (``experiments/preemption.py``): three panels.

matplotlib is imported inside ``save_preemption_plot`` only: the simulator imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# One color per way of preempting, the same in panels (b) and (c).
_RECOMPUTE, _SWAP_ONE, _SWAP_PER_LAYER = "tab:green", "tab:orange", "tab:blue"


def save_preemption_plot(result: dict[str, Any], path: Path) -> Path:
    """Write the PNG to ``path`` (its folder must exist) and return the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    fig, (ax_a, ax_b, ax_c) = plt.subplots(1, 3, figsize=(16, 4.6))

    # (a) The article's example: transfers for 1 GiB at 4 KiB/token, and their swap time.
    ex = result["article_example"]
    sizes = [p["block_size"] for p in ex["points"]]
    ax_a.plot(sizes, [p["transfers"] for p in ex["points"]], "o-", color="tab:blue")
    for p in ex["points"]:
        if p["block_size"] in (8, 16, 128):
            ax_a.annotate(
                f"{p['transfers']:,}",
                (p["block_size"], p["transfers"]),
                textcoords="offset points",
                xytext=(4, 6),
                fontsize=8,
            )
    ax_a.set(
        xscale="log",
        yscale="log",
        xlabel="block size B (tokens)",
        ylabel="block transfers",
        title="(a) 1 GiB of KV at 4 KiB/token",
    )
    ax_a.set_xticks(sizes, [str(b) for b in sizes])
    twin = ax_a.twinx()
    twin.plot(sizes, [1e3 * p["swap_s"] for p in ex["points"]], "s--", color="tab:red")
    twin.set_ylabel(f"swap time on {result['link']['name']} (ms)", color="tab:red")
    twin.set_yscale("log")

    # (b) OPT-13B: one way, 1 GiB, swap at two transfer counts vs recompute.
    opt = result["opt13b"]
    sizes = [p["block_size"] for p in opt["points"]]
    per_layer = opt["transfers_per_block_per_layer"]
    lines = (
        ("swap_s_per_layer_transfers", f"swap, {per_layer} transfers/block", _SWAP_PER_LAYER),
        ("swap_s_one_transfer_per_block", "swap, 1 transfer/block", _SWAP_ONE),
        ("recompute_s", "recompute (one prefill step)", _RECOMPUTE),
    )
    for key, label, color in lines:
        ax_b.plot(sizes, [1e3 * p[key] for p in opt["points"]], "o-", label=label, color=color)
    ax_b.set(
        xscale="log",
        yscale="log",
        xlabel="block size B (tokens)",
        ylabel="latency (ms)",
        title=f"(b) {result['model']} on {result['gpu']}: 1 GiB ({opt['tokens']:,} tokens)",
    )
    ax_b.set_xticks(sizes, [str(b) for b in sizes])
    ax_b.legend(fontsize=8)

    # (c) End to end: normalized latency per block size, each preemption mode.
    rows = result["end_to_end"]
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r["normalized_latency_s_per_token"] is None:
            continue
        n = r["transfers_per_block"]
        if r["mode"] == "recompute":
            style = ("recompute", _RECOMPUTE)
        elif n == 1:
            style = ("swap, 1 transfer/block", _SWAP_ONE)
        else:
            style = (f"swap, {n} transfers/block", _SWAP_PER_LAYER)
        series.setdefault(style, []).append((r["block_size"], r["normalized_latency_s_per_token"]))
    for (label, color), pts in series.items():
        pts.sort()
        ax_c.plot([b for b, _ in pts], [v for _, v in pts], "o-", label=label, color=color)
    sizes = sorted({r["block_size"] for r in rows})
    wl = result["workload"]
    ax_c.set(
        xscale="log",
        yscale="log",
        xlabel="block size B (tokens)",
        ylabel="normalized latency (s/token)",
        title=f"(c) ShareGPT-like, {wl['rate_per_s']:g} req/s, {wl['requests']} requests",
    )
    ax_c.set_xticks(sizes, [str(b) for b in sizes])
    ax_c.legend(fontsize=8)

    fig.suptitle(
        f"Swap vs recompute per block size (cost model: {result['cost_model']}; "
        f"host link {result['link']['name']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
