"""`pagedkv profile`: time the real engine's steps on this machine and fit the simulator's cost.

The engine (the embedded SmolLM2-135M unless --model) runs a grid of known batches for each
block size: single prompts of each --prefill-lens length, then for each --context-lens L a
batch of prompts of L tokens on average (spread over 1..2L) prefilled under the token budget
and decoded at each --batch-sizes size. Every engine step is timed whole (scheduling, forward
pass, sampling, detokenizing) and noted with the shape it computed. A linear model over those
shapes (per step, per new token, per sequence, per context token read, per query-key pair, per
KV block walked) is fitted by non-negative least squares on the relative error, and written
with the raw samples, the fit error and the machine to a JSON file that
`pagedkv simulate --cost-profile FILE` reads.

The numbers hold for this machine, this thread count and this engine version only; the default
grid takes a few minutes on a 2-core machine, --quick about a tenth of that.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedkv.commands.busy_machine import warn_if_busy
from pagedkv.commands.engine_flags import add_placement_args, add_tensor_parallel_arg
from pagedkv.commands.progress import ProgressLines
from pagedkv.errors import UsageError

# The grid: every size of the replays the simulator is checked against (decode batches up to
# 16, contexts of tens to hundreds of tokens, prefill chunks up to the 512-token budget).
DEFAULT_GRID = {
    "block_sizes": "16,64",
    "batch_sizes": "1,2,3,4,6,8,12,16",
    "context_lens": "64,256",
    "prefill_lens": "32,128,512",
    "steps": 3,
    "max_num_batched_tokens": 512,
}
QUICK_GRID = {
    "block_sizes": "16",
    "batch_sizes": "1,2",
    "context_lens": "16",
    "prefill_lens": "8,32",
    "steps": 2,
    "max_num_batched_tokens": 512,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="time the engine's steps on this machine; write a cost profile for simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g, q = DEFAULT_GRID, QUICK_GRID
    add = p.add_argument
    add("--model", help="GGUF file or Hugging Face folder (default: the embedded SmolLM2)")
    add_placement_args(p)
    add_tensor_parallel_arg(p)
    add("-o", "--output", default="cost-profile.json", help="JSON to write (%(default)s)")
    # Grid flags default to None: the grid (DEFAULT_GRID, or QUICK_GRID with --quick) fills
    # only what the user did not give, so --quick never overrides an explicit value.
    add("--block-sizes", help=f"one engine each ({g['block_sizes']}; --quick {q['block_sizes']})")
    add(
        "--batch-sizes", help=f"decode batch sizes ({g['batch_sizes']}; --quick {q['batch_sizes']})"
    )
    add(
        "--context-lens",
        help=f"mean decode contexts ({g['context_lens']}; --quick {q['context_lens']})",
    )
    add("--prefill-lens", help=f"single prompts ({g['prefill_lens']}; --quick {q['prefill_lens']})")
    add(
        "--steps",
        type=int,
        help=f"timed steps per decode point ({g['steps']}; --quick {q['steps']})",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        help=f"token budget per step: longer prompts run in chunks ({g['max_num_batched_tokens']})",
    )
    add("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    add(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time steps by elapsed time (default) or by this process's CPU time, which leaves "
        "out other processes on a shared machine (needs --threads 1)",
    )
    add("--seed", type=int, default=0, help="seed of the random prompt token ids")
    add(
        "--timeline",
        action="store_true",
        help="instead of the cost profile: time every step's phases (schedule, prepare, KV "
        "copies, forward, sampling, record, update; the forward's GPU time on a GPU) over "
        "--requests requests and print the medians per kind of step (writes --output)",
    )
    add("--requests", type=int, help="--timeline: requests (32)")
    add("--max-prompt", type=int, help="--timeline: longest prompt in tokens (512)")
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--timeline: schedule one step ahead (default: on a GPU)",
    )
    add(
        "--quick",
        action="store_true",
        help="a tiny grid in seconds (tests, a first look); grid flags given still apply",
    )
    p.set_defaults(func=run)


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag}: every value must be >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def grid_plan(grid: dict | None = None, **flags):
    """The ``ProfilePlan`` of a grid (default: ``DEFAULT_GRID``), as the flags would give it."""
    return _plan(argparse.Namespace(**{**(grid or DEFAULT_GRID), **flags}))


def _plan(args: argparse.Namespace):
    from pagedkv.engine.profiling import ProfilePlan

    grid = QUICK_GRID if getattr(args, "quick", False) else DEFAULT_GRID
    for key, value in grid.items():
        if getattr(args, key, None) is None:  # given flags win, --quick or not
            setattr(args, key, value)
    for name in ("steps", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", name
            )
    return ProfilePlan(
        block_sizes=_ints("--block-sizes", args.block_sizes),
        batch_sizes=_ints("--batch-sizes", args.batch_sizes),
        context_lens=_ints("--context-lens", args.context_lens),
        prefill_lens=_ints("--prefill-lens", args.prefill_lens),
        steps_per_point=args.steps,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():
        raise UsageError(f"--output {str(output)!r}: not a file in an existing folder")
    plan = _plan(args)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1", "threads")
    if args.clock == "cpu" and args.threads != 1:
        raise UsageError("--clock cpu needs --threads 1 (CPU time adds up over threads)", "clock")
    from pagedkv.engine import EngineConfig

    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        log_startup=False,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.timeline:
        from pagedkv.commands.profile_timeline import run_timeline

        return run_timeline(args, base)
    timeline_only = ("requests", "max_prompt", "async_scheduling")
    if given := [f"--{n.replace('_', '-')}" for n in timeline_only if getattr(args, n) is not None]:
        raise UsageError(f"{', '.join(given)} applies to --timeline only", given[0].lstrip("-"))
    if args.clock == "wall":  # CPU time leaves other processes out already
        warn_if_busy(
            "profile",
            args.threads,
            "--threads 1 --clock cpu",
            "timed steps include the wait for the CPU; --clock cpu leaves it out",
            device=args.device,
        )
    profile = measure(base, plan, args.threads, args.seed, progress=True, clock=args.clock)
    profile.write(output)
    _report(profile, output)
    return 0


def measure(
    base,
    plan,
    threads: int | None,
    seed: int = 0,
    progress: bool = False,
    clock: str = "wall",
    loaded=None,
):
    """Load the model (unless ``loaded``), time ``plan`` on ``clock`` and fit: the
    ``CostProfile`` (not yet written)."""
    import dataclasses

    import rich.console
    import rich.progress
    import torch

    from pagedkv.engine.pool_plan import engine_placement
    from pagedkv.engine.profiling import machine_meta, profile_engine
    from pagedkv.sim.costs.profile_fit import build_profile

    if threads is not None:
        torch.set_num_threads(threads)
    placement = engine_placement(base)
    base = dataclasses.replace(base, dtype=placement.dtype)  # the KV record size reads it
    given = loaded  # a model the caller built (no path to name it by)
    if loaded is None:
        loaded = _load(base, placement, progress)
    columns = (
        *rich.progress.Progress.get_default_columns(),
        rich.progress.TextColumn("{task.fields[what]}"),
    )
    # A live bar on a terminal's stderr; elsewhere (a log, a pipe) rich would show nothing
    # until the end, so a plain line per grid point instead. stdout keeps only the report.
    console = rich.console.Console(stderr=True)
    live = progress and console.is_terminal
    lines = ProgressLines(plan.num_points, "pagedkv profile", "points")
    with rich.progress.Progress(*columns, console=console, disable=not live, transient=True) as bar:
        task = bar.add_task("profiling", total=plan.num_points, what="")

        def on_point(what: str) -> None:
            bar.update(task, advance=1, what=what)
            lines.advance(1, what, quiet=live or not progress)

        samples = profile_engine(loaded, base, plan, on_point, seed, clock)
    meta = {
        "model": base.model
        or ("embedded SmolLM2-135M-Instruct" if given is None else _shape_name(loaded[0])),
        "dtype": placement.dtype,
        "device": placement.describe(),
        **machine_meta(torch.get_num_threads()),
        "clock": clock,
        "block_sizes": list(plan.block_sizes),
        "plan": dict(plan.__dict__),
    }
    return build_profile(samples, meta)


def _load(base, placement, progress: bool):
    """``(config, model, tokenizer)`` to profile; under tensor parallelism the config alone
    (each engine's ranks load their shares)."""
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.loader import load_model, read_model_shape

    if base.tensor_parallel_size > 1:
        return ModelConfig.from_shape(read_model_shape(base.model)), None, None
    return load_model(base.model, placement.dtype, progress=progress, device=placement.device)


def _report(profile, output: Path) -> None:
    import rich.console
    import rich.table

    table = rich.table.Table(title="fitted step cost: seconds per unit")
    table.add_column("coefficient")
    table.add_column("value", justify="right")
    for name, value in profile.model.coefficients.items():
        table.add_row(name, f"{value:.4g}")
    for count, offset in profile.model.token_offsets_s.items():
        table.add_row(f"offset_s at {count} new token{'s' if count > 1 else ''}", f"{offset:+.4g}")
    console = rich.console.Console()
    console.print(profile.describe())
    console.print(table)
    fit = profile.fit
    console.print(
        f"fit over {fit.num_samples} timed steps ({fit.num_outliers} left out as disturbed, "
        f"off by more than 3x the median): relative error rms {fit.rms_rel_error:.1%}, "
        f"median {fit.median_abs_rel_error:.1%}, p90 {fit.p90_abs_rel_error:.1%}, max "
        f"{fit.max_abs_rel_error:.1%}; summed time {fit.total_rel_error:+.1%}"
    )
    console.print(f"wrote {output} (use: pagedkv simulate --cost-profile {output} ...)")


def _shape_name(config) -> str:
    """A model given without a path, named by its shape (``ModelConfig``)."""
    return (
        f"{config.architecture} ({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads / {config.num_kv_heads} KV heads)"
    )
