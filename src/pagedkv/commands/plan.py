"""`pagedkv plan`: for my model, GPU and workload, which block size, and what does each cost?

A thin edge: parse and validate the arguments (every bad value is one error line, exit 2),
build a ``KVLayout`` and a ``Workload``, call ``pagedkv.planner.plan.build_plan``, then print a
rich table or JSON, and optionally a plot. Numbers are parsed here, not by argparse, so that a
bad value is reported as one line naming the option.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.commands.overwrite import add_force_flag
from pagedkv.commands.plan_clocks import copy_clocks, decode_clock
from pagedkv.commands.plan_workload import workload_from_args
from pagedkv.commands.plot_path import prepare_plot_path
from pagedkv.errors import UsageError
from pagedkv.units import parse_bytes, parse_count, parse_int_list


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="price every block size for a model and workload; recommend one",
        description=(
            "Compute the four ledgers of the KV block size (block table, internal "
            "fragmentation, prefix reuse, hard constraints) and W(B); recommend the allowed "
            "block size with the least waste. MB = 10^6 bytes, KiB = 1024 bytes."
        ),
    )
    model = p.add_argument_group("model (one of)")
    model.add_argument("--model", help="preset name, config.json (or its folder), or .gguf")
    model.add_argument("--record-bytes", metavar="C", help="KV bytes per token, all layers")
    model.add_argument("--kv-dtype", help="fp32, fp16, bf16, fp8, mxfp8, fp4 (default: model's)")
    model.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        default="1",
        metavar="N",
        help="plan one rank of N (tensor parallel): its KV heads' page bytes (replicated heads "
        "as the engine holds them), its share of the weights against --gpu-memory, and with "
        "--gpu its step with two all-reduces a layer (1)",
    )
    work = p.add_argument_group("workload (parameters or --trace)")
    work.add_argument("--num-seqs", metavar="K", help="live sequences at once (required)")
    work.add_argument("--mean-len", metavar="L", help="mean sequence length, tokens (32k = 32768)")
    work.add_argument("--max-len", metavar="L_MAX", help="longest sequence, tokens")
    work.add_argument("--prefix-len", metavar="P", help="shared prefix length, tokens")
    work.add_argument("--prefix-range", metavar="A:B", help="P uniform over integers A..B")
    work.add_argument("--prefix-hits", metavar="H", help="prefix hits (default: K with a prefix)")
    work.add_argument("--trace", metavar="FILE", help="Azure CSV or Mooncake JSONL trace")
    work.add_argument(
        "--strict",
        action="store_true",
        help="fail on a trace line that does not parse "
        "(default: skip it with a warning naming its line)",
    )
    p.add_argument("--block-sizes", default="1,8,16,32,64,128", help="candidates (tokens)")
    p.add_argument(
        "--prefix-match-unit",
        metavar="U",
        help="partial-block reuse: prefixes match in units of U tokens at every B that U "
        "divides (B <= U: whole blocks), so a hit loses P mod U tokens, not P mod B; the tokens "
        "reused out of a partial block are copied (with --gpu: priced against recomputing them)",
    )
    p.add_argument("--backend", default="torch-sdpa", help="attention backend (hard limits)")
    p.add_argument("--alignment-bytes", default="128", help="block base alignment reported")
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="price the time ledger too: one decode step of K sequences "
        "at the mean length per B, on the simulator's fitted clock of this GPU (needs --model): "
        "with --backend triton pagedkv's own (pagedkv-triton), else the vLLM-class reference; "
        "the recommendation then drops B whose step is > 5%% slower than the fastest",
    )
    p.add_argument("--swap-bytes", default="1GiB", help="KV volume priced in block transfers")
    mem = p.add_argument_group("memory budget (optional): --memory, or --gpu-memory minus the rest")
    mem.add_argument("--memory", metavar="SIZE", help="KV pool size, e.g. 58GiB")
    mem.add_argument("--gpu-memory", metavar="SIZE", help="device memory, e.g. 80GiB")
    mem.add_argument("--weights", metavar="SIZE", help="weight bytes (default: the model's)")
    mem.add_argument("--activations", metavar="SIZE", default="0", help="activation bytes")
    mem.add_argument("--overhead", metavar="SIZE", default="0", help="other reserved bytes")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write the plot (matplotlib); a file git tracks only with --force",
    )
    add_force_flag(p)
    p.set_defaults(func=run)


def _layout(args: argparse.Namespace):
    from pagedkv.pages.layout import layout_from_record_bytes, load_layout

    if (args.model is None) == (args.record_bytes is None):
        raise UsageError("give exactly one of --model PRESET|config.json and --record-bytes C")
    if args.model is not None:
        try:
            return load_layout(args.model, kv_dtype=args.kv_dtype)
        except UsageError:
            raise
        except ValueError as exc:  # the model source validates with ValueError: the user's file
            raise UsageError(str(exc), "--model") from None
    if args.kv_dtype is not None:
        raise UsageError("--kv-dtype needs --model: --record-bytes already fixes the bytes")
    record_bytes = parse_bytes("--record-bytes", args.record_bytes)
    if record_bytes < 1:
        raise UsageError(f"--record-bytes must be >= 1, got {record_bytes}")
    return layout_from_record_bytes(record_bytes)


def _pool_bytes(args: argparse.Namespace, layout) -> int | None:
    if args.memory is not None and args.gpu_memory is not None:
        raise UsageError("give --memory (the KV pool) or --gpu-memory, not both")
    if args.memory is not None:
        return parse_bytes("--memory", args.memory)
    if args.gpu_memory is None:
        return None
    if args.weights is not None:
        weights = parse_bytes("--weights", args.weights)
    elif layout.weight_bytes is not None:
        weights = layout.weight_bytes
    else:
        raise UsageError(
            "--gpu-memory needs --weights SIZE: the model's parameter count is unknown"
        )
    pool = parse_bytes("--gpu-memory", args.gpu_memory) - weights
    pool -= parse_bytes("--activations", args.activations) + parse_bytes(
        "--overhead", args.overhead
    )
    if pool < 1:
        raise UsageError(f"no memory left for the KV pool ({pool} bytes after weights etc.)")
    return pool


def run(args: argparse.Namespace) -> int:
    from pagedkv.planner.constraints import resolve_block_size
    from pagedkv.planner.plan import build_plan

    if args.plot:
        prepare_plot_path(args.plot, args.force)
    args.tp = parse_count("--tensor-parallel-size", args.tp)
    layout = _rank_layout(_layout(args), args.tp)
    workload = workload_from_args(args)
    unit = None
    if args.prefix_match_unit is not None:
        unit = parse_count("--prefix-match-unit", args.prefix_match_unit)
        if unit < 1:
            raise UsageError("--prefix-match-unit must be >= 1 token", "--prefix-match-unit")
    decode_step_s, clock_source, cost = decode_clock(args, layout, workload)
    copy_s, recompute_s = (None, None) if cost is None else copy_clocks(args, cost, workload)
    plan = build_plan(
        layout,
        workload,
        block_sizes=parse_int_list("--block-sizes", args.block_sizes),
        backend=args.backend,
        pool_bytes=_pool_bytes(args, layout),
        swap_bytes=parse_bytes("--swap-bytes", args.swap_bytes),
        alignment_bytes=max(1, parse_bytes("--alignment-bytes", args.alignment_bytes)),
        decode_step_s=decode_step_s,
        clock_source=clock_source,
        prefix_match_unit=unit,
        copy_s=copy_s,
        recompute_s=recompute_s,
    )
    log_line = None
    if plan.recommended_block_size is not None:
        block_size = plan.recommended_block_size
        num_blocks = (
            None if plan.pool_bytes is None else plan.pool_bytes // layout.block_bytes(block_size)
        )
        log_line = resolve_block_size(block_size, plan.backend, layout, num_blocks).log_line()
    if args.plot:
        _save_plot(plan, args.plot)
    _report(args, plan, layout, log_line)
    return 0


def _report(args: argparse.Namespace, plan, layout, log_line: str | None) -> None:
    """The plan as JSON or tables; for an MLA model, each framework's page for it too (the first
    article's thought experiment)."""
    from pagedkv.planner.framework_pages import framework_pages, pages_to_json, render_pages
    from pagedkv.planner.report import plan_to_json, render_plan

    pages = framework_pages(layout, plan.pool_bytes) if layout.attention == "mla" else None
    if args.json:
        out = {**plan_to_json(plan, log_line), "tensor_parallel_size": args.tp}
        if pages is not None:
            out["framework_pages"] = pages_to_json(pages)
        json.dump(out, sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=132)
    render_plan(plan, console, log_line)
    if pages is not None:
        render_pages(layout, pages, console)
    if args.plot:
        print(f"plot written to {args.plot}")


def _rank_layout(layout, tp: int):
    """One rank's layout at ``tp`` ranks (``pages/head_split.py``; ``UsageError`` in one line
    for a size the heads refuse), named so; the layout itself at 1. ``args.tp`` becomes the
    count."""
    from dataclasses import replace

    from pagedkv.pages.head_split import rank_layout

    if tp < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {tp}", "tensor_parallel_size")
    if tp == 1:
        return layout
    return replace(rank_layout(layout, tp), name=f"{layout.name}, one rank of TP {tp}")


def _save_plot(plan, path: str) -> None:
    try:
        from pagedkv.planner.plot import save_plan_plot

        save_plan_plot(plan, path)
    except ImportError as exc:
        raise UsageError(f"--plot needs matplotlib (pip install 'pagedkv[plot]'): {exc}") from None
    except OSError as exc:
        raise UsageError(f"--plot: cannot write {path!r}: {exc.strerror or exc}") from None
