"""`pagedkv capacity`: on one KV pool, how many tokens does each model fit? (an MLA model's
latent records against a GQA model's K and V; ``planner/capacity.py``)."""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.errors import UsageError
from pagedkv.units import format_bytes, parse_bytes, parse_count

DEFAULT_MODELS = "deepseek-v2-lite,llama-3-8b"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "capacity",
        help="tokens of KV each model fits in one pool (MLA vs GQA)",
        description=(
            "Compare models on one KV pool: record bytes per token (all layers, from the same "
            "layout the engine prints at start-up), whole blocks of --block-size tokens, and "
            "the tokens that fit. GiB = 2^30 bytes, KiB = 1024."
        ),
    )
    p.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated presets, config.json paths or .gguf files ({DEFAULT_MODELS})",
    )
    p.add_argument("--memory", default="40GiB", metavar="SIZE", help="the KV pool (40GiB)")
    p.add_argument("--kv-dtype", help="fp32, fp16, bf16, fp8, mxfp8, fp4 (default: each model's)")
    p.add_argument("--block-size", default="16", metavar="B", help="tokens per block (16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv.pages.layout import load_layout
    from pagedkv.planner.capacity import pool_capacity

    pool_bytes = parse_bytes("--memory", args.memory)
    block_size = parse_count("--block-size", args.block_size)
    if pool_bytes < 1 or block_size < 1:
        raise UsageError("--memory and --block-size must be positive", "--memory")
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        raise UsageError("--models names no model", "--models")
    rows = [pool_capacity(load_layout(n, args.kv_dtype), pool_bytes, block_size) for n in names]
    if args.json:
        out = [{**r.__dict__, "x_first": r.tokens / max(rows[0].tokens, 1)} for r in rows]
        json.dump({"pool_bytes": pool_bytes, "models": out}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _render(rows, pool_bytes)
    return 0


def _render(rows, pool_bytes: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV capacity of one {format_bytes(pool_bytes)} pool")
    columns = ("model", "attention", "params", "KV B/token", "B/token per 1e9 params")
    for column in (*columns, "block KiB", "blocks", "tokens", "x first"):
        table.add_column(column, justify="left" if column == "model" else "right")
    first = max(rows[0].tokens, 1)
    for r in rows:
        params = "?" if r.num_params is None else f"{r.num_params / 1e9:.1f}e9"
        fair = r.record_bytes_per_billion_params
        cells = [r.model, r.attention, params, f"{r.record_bytes:,} ({r.kv_dtype})"]
        cells += ["?" if fair is None else f"{fair:,.0f}", f"{r.block_bytes / 1024:,.1f}"]
        cells += [f"{r.num_blocks:,}", f"{r.tokens:,}", f"{r.tokens / first:.2f}"]
        table.add_row(*cells)
    console = Console()
    if not console.is_terminal:
        console = Console(width=132)
    console.print(table)
