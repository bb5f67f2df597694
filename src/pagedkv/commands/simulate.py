"""`pagedkv simulate`: replay a trace through the real scheduler and allocators, per policy.

A thin edge: validate the arguments into a ``SimulateArgs`` (every bad value is one error line,
exit 2), load or generate the requests, size the KV pool, run ``sim.compare.Comparison`` and
print a rich table (or JSON), optionally a plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from pagedkv.errors import UsageError
from pagedkv.units import parse_bytes, parse_tokens


@dataclass(frozen=True)
class SimulateArgs:
    """The validated arguments. ``kv_memory_bytes`` empty: derive the pool from the GPU."""

    trace: str | None
    synthetic: str | None
    model: str
    kv_dtype: str | None
    gpu: str
    kv_memory_bytes: tuple[int, ...]
    gpu_memory_utilization: float
    activation_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption: str
    policies: tuple[str, ...]
    block_sizes: tuple[int, ...]
    max_requests: int | None
    strict: bool
    rate_scale: float
    seed: int
    step_overhead_s: float
    sample_interval_s: float
    json: bool
    plot: str | None


def _int_list(option: str, text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UsageError(f"{option}: values must be >= 1, got {text!r}")
    return values


def _number(option: str, text: str, kind: type = float, minimum: float = 0.0) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"{option}: expected a number, got {text!r}") from None
    if value < minimum:
        raise UsageError(f"{option}: must be >= {minimum}, got {text!r}")
    return value


def validate(a: argparse.Namespace) -> SimulateArgs:
    if bool(a.trace) == bool(a.synthetic):
        raise UsageError("give exactly one of --trace FILE or --synthetic SPEC")
    policies = tuple(p.strip() for p in a.policy.split(",") if p.strip())
    if not policies:
        raise UsageError("--policy: name at least one policy")
    return SimulateArgs(
        trace=a.trace,
        strict=a.strict,
        synthetic=a.synthetic,
        model=a.model,
        kv_dtype=a.kv_dtype,
        gpu=a.gpu,
        kv_memory_bytes=tuple(
            parse_bytes("--kv-memory", v) for v in (a.kv_memory or "").split(",") if v.strip()
        ),
        gpu_memory_utilization=_number("--gpu-memory-utilization", a.gpu_memory_utilization),
        activation_bytes=parse_bytes("--activation-memory", a.activation_memory),
        max_model_len=parse_tokens("--max-model-len", a.max_model_len),
        max_num_seqs=int(_number("--max-num-seqs", a.max_num_seqs, int, 1)),
        max_num_batched_tokens=parse_tokens("--max-num-batched-tokens", a.max_num_batched_tokens),
        preemption=a.preemption,
        policies=policies,
        block_sizes=_int_list("--block-sizes", a.block_sizes),
        max_requests=int(_number("--max-requests", a.max_requests, int, 1))
        if a.max_requests
        else None,
        rate_scale=_number("--rate-scale", a.rate_scale, float, 1e-9),
        seed=int(_number("--seed", a.seed, int, 0)),
        step_overhead_s=_number("--step-overhead-ms", a.step_overhead_ms) / 1000.0,
        sample_interval_s=_number("--sample-interval", a.sample_interval, float, 1e-6),
        json=a.json,
        plot=a.plot,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a trace through the real scheduler and allocators under each policy",
        description=(
            "Replay a request trace (or a synthetic workload) through pagedkv's own scheduler "
            "and KV allocators, with the model replaced by a roofline cost model, once per "
            "policy; compare concurrency, KV waste, prefix hits, preemptions and latency. "
            "Sizes: GB = 10^9 bytes, GiB = 2^30; token counts accept 32k = 32768."
        ),
    )
    src = p.add_argument_group("workload (one of)")
    src.add_argument("--trace", metavar="FILE", help="Azure LLM 2023 .csv or Mooncake .jsonl")
    src.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="e.g. requests=200,prompt=2000-9000,output=200-800,rate=inf,system=0,turns=1,gap=10",
    )
    p.add_argument("--max-requests", metavar="N", help="replay only the first N requests")
    p.add_argument(
        "--strict", action="store_true", help="fail on a trace line that does not parse "
        "(default: skip it with a warning naming its line)",
    )  # fmt: skip
    p.add_argument("--rate-scale", default="1", metavar="X", help="X times the trace's rate")
    p.add_argument("--seed", default="0", help="seed of the synthetic workload")
    hw = p.add_argument_group("model and hardware")
    hw.add_argument("--model", default="llama-3-8b", help="preset name or config.json")
    hw.add_argument("--kv-dtype", help="KV cache dtype (default: the model's)")
    hw.add_argument("--gpu", default="A100-80GB", help="A100-80GB, H100-80GB, H200-141GB, L4")
    hw.add_argument(
        "--kv-memory", metavar="SIZE[,SIZE]", help="KV pool size(s), e.g. 58GiB; else derived"
    )
    hw.add_argument(
        "--gpu-memory-utilization", default="0.9", metavar="F", help="share of GPU memory (0.9)"
    )
    hw.add_argument(
        "--activation-memory", default="4GiB", metavar="SIZE", help="reserved for activations"
    )
    hw.add_argument("--step-overhead-ms", default="2", metavar="MS", help="fixed cost per step (2)")
    sc = p.add_argument_group("scheduler")
    sc.add_argument("--max-model-len", default="32k", metavar="N", help="context limit (32k)")
    sc.add_argument("--max-num-seqs", default="256", metavar="N", help="running at most (256)")
    sc.add_argument(
        "--max-num-batched-tokens", default="8192", metavar="N", help="tokens per step (8192)"
    )
    sc.add_argument(
        "--preemption", default="latest_arrival", help="victim: latest_arrival or least_computed"
    )
    pol = p.add_argument_group("policies")
    pol.add_argument(
        "--policy",
        default="reserved,vllm",
        help="comma list of vllm, sglang, trtllm, llamacpp, deepinfer, reserved, or KIND:B "
        "(paged:32, paged-nocache:16, radix:1)",
    )
    pol.add_argument("--block-sizes", metavar="B,B", help="run each paged/radix policy at each")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object per run")
    out.add_argument("--plot", metavar="FILE.png", help="KV utilization, running, waste plots")
    out.add_argument("--sample-interval", default="1", metavar="S", help="simulated s/sample")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    args = validate(a)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from pagedkv.planner.layout import load_layout
    from pagedkv.sched import SchedulerConfig
    from pagedkv.sim.compare import Comparison, expand_policies
    from pagedkv.sim.cost_model import ModelCost, RooflineCostModel, kv_pool_bytes
    from pagedkv.sim.gpus import get_gpu
    from pagedkv.sim.report import plot_runs, print_table
    from pagedkv.sim.synthetic import generate, parse_spec
    from pagedkv.sim.traces import load_trace, rescale

    layout = load_layout(args.model, kv_dtype=args.kv_dtype)
    model = ModelCost.from_layout(layout)
    gpu = get_gpu(args.gpu)
    pools_bytes = args.kv_memory_bytes or (
        kv_pool_bytes(gpu, model.weight_bytes, args.gpu_memory_utilization, args.activation_bytes),
    )
    pools_slots = [b // model.kv_record_bytes for b in pools_bytes]
    policies = expand_policies(args.policies, args.block_sizes)
    if args.trace:
        skipped: list[ValueError] = []
        lenient = {} if args.strict else {"on_bad_line": skipped.append}
        requests = load_trace(args.trace, args.max_requests, args.rate_scale, **lenient)
        if skipped:  # one bad record does not cost the replay of the others
            shown = "; ".join(str(e) for e in skipped[:3])
            more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
            print(f"pagedkv simulate: warning: skipped {len(skipped)} unparsable line(s): "
                  f"{shown}{more}; --strict makes this an error", file=sys.stderr)  # fmt: skip
        source = args.trace
    else:
        requests = rescale(generate(parse_spec(args.synthetic or ""), args.seed), args.rate_scale)
        requests = requests[: args.max_requests] if args.max_requests else requests
        source = f"synthetic {args.synthetic} (seed {args.seed})"
    if not requests:
        raise UsageError("the workload has no requests")
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        preemption=args.preemption,
    )
    if min(pools_slots) < args.max_model_len and any(p.allocator == "reserved" for p in policies):
        raise UsageError(
            f"a KV pool of {min(pools_slots)} tokens cannot hold one max_model_len region "
            f"({args.max_model_len}) for the reserved policy"
        )
    cost = RooflineCostModel(model, gpu, args.step_overhead_s)

    err = Console(stderr=True, soft_wrap=True)
    mean_prompt = sum(r.prompt_len_tokens for r in requests) / len(requests)
    mean_output = sum(r.output_len_tokens for r in requests) / len(requests)
    err.print(
        f"[bold]{source}[/]: {len(requests)} requests, mean prompt {mean_prompt:,.0f} + "
        f"output {mean_output:,.0f} tokens over {requests[-1].arrival_time_s:,.1f} s\n"
        f"{layout.name}: {model.kv_record_bytes:,} KV bytes/token ({layout.kv_dtype}), "
        f"weights {model.weight_bytes / 1e9:.1f} GB on {gpu.name}; KV pool "
        + ", ".join(
            f"{b / 2**30:,.2f} GiB = {n:,} tokens"
            for b, n in zip(pools_bytes, pools_slots, strict=True)
        )
        + f"; max_model_len "
        f"{args.max_model_len:,}, max_num_seqs {args.max_num_seqs}, budget "
        f"{args.max_num_batched_tokens:,} tokens/step"
    )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("t={task.fields[sim_s]:,.0f} s"),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        runs = []
        for slots in pools_slots:

            def track(policy, slots=slots):  # one bar per run
                task = progress.add_task(
                    f"{policy.name} ({slots:,} slots)", total=len(requests), sim_s=0.0
                )
                return lambda done, sim_s: progress.update(task, completed=done, sim_s=sim_s)

            comparison = Comparison(requests, slots, config, cost, args.sample_interval_s)
            runs += comparison.run(policies, track)
    summaries = [s for _, s in runs]
    if args.json:
        print(json.dumps(summaries, indent=2))
    else:
        print_table(summaries, f"pagedkv simulate: {source}", Console())
    if args.plot:
        plot_runs([r for r, _ in runs], args.plot)
        err.print(f"plot written to {args.plot}")
    return 0
