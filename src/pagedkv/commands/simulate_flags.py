"""`pagedkv simulate`'s flags, and the one place that turns them into a ``SimulateConfig``.

Cheap to import (the simulator is imported lazily): the command checks every flag, one error
line and exit 2 for a bad value, before a replay starts.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pagedkv import units
from pagedkv.commands.engine_flags import add_swap_args, swap_space_bytes
from pagedkv.commands.overwrite import add_force_flag
from pagedkv.errors import UsageError
from pagedkv.units import parse_bytes, parse_count, parse_int_list, parse_number, parse_tokens

if TYPE_CHECKING:
    from pagedkv.sim.simulate_config import SimulateConfig


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    """The workload, model and hardware, scheduler, policies, replicas and output flags."""
    src = p.add_argument_group("workload (one of)")
    src.add_argument("--trace", metavar="FILE", help="Azure LLM 2023 .csv or Mooncake .jsonl")
    src.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="e.g. requests=200,prompt=2000-9000,output=200-800,rate=inf,system=0,turns=1,gap=10",
    )
    p.add_argument("--max-requests", metavar="N", help="replay only the first N requests")
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on a trace line that does not parse "
        "(default: skip it with a warning naming its line)",
    )
    p.add_argument("--rate-scale", default="1", metavar="X", help="X times the trace's rate")
    p.add_argument("--seed", default="0", help="seed of the synthetic workload")
    hw = p.add_argument_group("model and hardware")
    hw.add_argument("--model", default="llama-3-8b", help="preset name or config.json")
    hw.add_argument("--kv-dtype", help="KV cache dtype (default: the model's)")
    hw.add_argument(
        "--gpu",
        default="A100-80GB",
        help="A10, A40, L4, L40S, A100-40GB, A100-80GB, "
        "H100-80GB (SXM), H100-PCIe, H200-141GB, B200 (datasheets: sim/gpus.py)",
    )
    hw.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        default="1",
        metavar="N",
        help="GPUs per replica, tensor parallel: each holds its KV heads of every token (the "
        "engine's head split, replicated heads counted on each) and two all-reduces a layer "
        "go over the GPU's link (fitted clocks: vllm-class or pagedkv-triton) (1)",
    )
    hw.add_argument(
        "--kv-memory", metavar="SIZE[,SIZE]", help="KV pool size(s), e.g. 58GiB; else derived"
    )
    hw.add_argument(
        "--gpu-memory-utilization", default="0.9", metavar="F", help="share of GPU memory (0.9)"
    )
    hw.add_argument(
        "--activation-memory", default="4GiB", metavar="SIZE", help="reserved for activations"
    )
    hw.add_argument(
        "--step-overhead-ms",
        default="2",
        metavar="MS",
        help="fixed cost per step of the kernel and roofline clocks (2)",
    )
    hw.add_argument(
        "--cost",
        choices=("fitted", "kernel", "roofline"),
        default="fitted",
        help="step clock: fitted = every op priced by the GPU's clock fitted to measured kernel "
        "times (default; docs/gpu_clock.md), kernel = roofline + an assumed attention block "
        "walk per framework, roofline = bytes and FLOPs only (blind to the block size)",
    )
    hw.add_argument(
        "--clock",
        metavar="FILE|KIND",
        help="--cost fitted's clock: a `pagedkv "
        "calibrate` JSON, or the kind shipped for the GPU: vllm-class (default: the "
        "reference, fitted to Vidur's vLLM profiles) or pagedkv-triton (pagedkv's own "
        "engine, fitted to its device check; docs/gpu_clock.md)",
    )
    hw.add_argument(
        "--cuda-graphs",
        choices=("on", "off"),
        help="a pagedkv-triton clock: decode steps replayed from CUDA graphs (the engine's "
        "default: on) or eager",
    )
    hw.add_argument(
        "--kernel",
        metavar="BACKEND",
        help="price every paged policy with this attention "
        "kernel (vllm, trtllm-mha, flashinfer, fa4, flashmla, torch-sdpa); default: each "
        "policy's own (vllm -> vllm, sglang -> flashinfer, trtllm -> trtllm-mha)",
    )
    hw.add_argument(
        "--cost-profile",
        metavar="FILE",
        help="a `pagedkv profile` JSON: its fitted step cost replaces the GPU cost model",
    )
    sc = p.add_argument_group("scheduler")
    sc.add_argument("--max-model-len", default="32k", metavar="N", help="context limit (32k)")
    sc.add_argument("--max-num-seqs", default="256", metavar="N", help="running at most (256)")
    sc.add_argument(
        "--max-num-batched-tokens", default="8192", metavar="N", help="tokens per step (8192)"
    )
    sc.add_argument(
        "--preemption", default="latest_arrival", help="victim: latest_arrival or least_computed"
    )
    add_swap_args(sc)
    sc.add_argument(
        "--host-link", metavar="NAME", help="pcie4-x16 or pcie5-x16 (default: the GPU's own)"
    )
    pol = p.add_argument_group("policies")
    pol.add_argument(
        "--policy",
        default="reserved,vllm",
        help="comma list of vllm, sglang, trtllm, llamacpp, deepinfer, reserved, or KIND:B "
        "(paged:32, paged-nocache:16, radix:1)",
    )
    pol.add_argument("--block-sizes", metavar="B,B", help="run each paged/radix policy at each")
    pol.add_argument(
        "--prefix-match-unit",
        metavar="U[,U]",
        help="run each policy with a prefix cache matching prefixes in units of U tokens, once "
        "per U (B: whole blocks); U must divide the block size. Below it a hit may end inside "
        "a block, whose matched slots are copied (priced on the GPU's memory) or claimed",
    )
    rt = p.add_argument_group("replicas and routing")
    rt.add_argument(
        "--replicas",
        default="1",
        metavar="N",
        help="N engines, each with its own scheduler "
        "and KV pool, behind a router (default 1: one engine, no router)",
    )
    rt.add_argument(
        "--router",
        metavar="POLICY[,POLICY]",
        help="routing policies, one run each: "
        "round-robin, least-loaded, prefix-aware (default with --replicas > 1: round-robin; "
        "with --replicas 1 the cluster table of one replica, the same numbers as one engine)",
    )
    rt.add_argument(
        "--balance-abs",
        default="4",
        metavar="N",
        help="prefix-aware: a replica more than N requests above the least loaded is skipped (4)",
    )
    rt.add_argument(
        "--balance-rel",
        default="0.25",
        metavar="F",
        help="prefix-aware: ... or more than F x the least loaded's requests (0.25)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object per run")
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="KV utilization, running, waste plots (a file git tracks only with --force)",
    )
    add_force_flag(out)
    out.add_argument("--sample-interval", default="1", metavar="S", help="simulated s/sample")


def _int_list(option: str, text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    values = parse_int_list(option, text)
    if any(v < 1 for v in values):
        raise UsageError(f"{option}: values must be >= 1, got {text!r}", option)
    return values


def validate(a: argparse.Namespace) -> SimulateConfig:
    """The flags as a validated ``SimulateConfig`` (UsageError naming the flag otherwise)."""
    from pagedkv.sim.simulate_config import SimulateConfig

    if bool(a.trace) == bool(a.synthetic):
        raise UsageError("give exactly one of --trace FILE or --synthetic SPEC")
    policies = tuple(p.strip() for p in a.policy.split(",") if p.strip())
    if not policies:
        raise UsageError("--policy: name at least one policy", "--policy")
    routers: tuple[str, ...] = ()
    if a.router is not None:
        routers = tuple(r.strip() for r in a.router.split(",") if r.strip())
        if not routers:
            raise UsageError("--router: name at least one routing policy", "--router")
    num_replicas = parse_count("--replicas", a.replicas)
    if num_replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {a.replicas!r}", "--replicas")
    if a.plot and (num_replicas > 1 or routers):
        raise UsageError("--plot draws one engine's runs: drop it with --replicas/--router")
    return SimulateConfig(
        trace=a.trace,
        synthetic=a.synthetic,
        model=a.model,
        kv_dtype=a.kv_dtype,
        gpu=a.gpu,
        kv_memory_bytes=tuple(
            parse_bytes("--kv-memory", v) for v in (a.kv_memory or "").split(",") if v.strip()
        ),
        gpu_memory_utilization=parse_number("--gpu-memory-utilization", a.gpu_memory_utilization),
        activation_bytes=parse_bytes("--activation-memory", a.activation_memory),
        max_model_len=parse_tokens("--max-model-len", a.max_model_len),
        max_num_seqs=parse_count("--max-num-seqs", a.max_num_seqs),
        max_num_batched_tokens=parse_tokens("--max-num-batched-tokens", a.max_num_batched_tokens),
        preemption=a.preemption,
        policies=policies,
        block_sizes=_int_list("--block-sizes", a.block_sizes),
        prefix_match_units=units.parse_unit_list("--prefix-match-unit", a.prefix_match_unit),
        max_requests=parse_count("--max-requests", a.max_requests) if a.max_requests else None,
        strict=a.strict,
        rate_scale=parse_number("--rate-scale", a.rate_scale, minimum=1e-9),
        seed=parse_count("--seed", a.seed),
        step_overhead_s=parse_number("--step-overhead-ms", a.step_overhead_ms, minimum=0) / 1000,
        sample_interval_s=parse_number("--sample-interval", a.sample_interval, minimum=1e-6),
        cost=a.cost,
        clock=a.clock,
        cuda_graphs=None if a.cuda_graphs is None else a.cuda_graphs == "on",
        tensor_parallel=parse_count("--tensor-parallel-size", a.tp),
        kernel=a.kernel,
        cost_profile=a.cost_profile,
        preemption_mode=a.preemption_mode,
        swap_space_bytes=swap_space_bytes(a),
        host_link=a.host_link,
        num_replicas=num_replicas,
        routers=routers,
        balance_abs=parse_count("--balance-abs", a.balance_abs),
        balance_rel=parse_number("--balance-rel", a.balance_rel, minimum=0),
    )
