"""Flags shared by the commands that run the engine (`generate`, `serve`, `demo`), and the
one place that turns them into an ``EngineConfig`` and ``SamplingParams``.

Everything here is cheap and imports no torch: a command validates its flags (and fails with
one line) before the slow model load starts.
"""

from __future__ import annotations

import argparse

from pagedkv.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION
from pagedkv.pages.backends import ALIASES, RULES
from pagedkv.pages.kv_dtypes import ENGINE_DTYPES
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.preemption import PREEMPTION_MODES
from pagedkv.units import parse_bytes


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and KV cache options shared by the commands that run the engine."""
    g = p.add_argument_group("model and KV cache")
    g.add_argument("--model", help="GGUF file or Hugging Face folder (default: embedded SmolLM2)")
    add_placement_args(g)
    add_tensor_parallel_arg(g)
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps from CUDA graphs captured per batch-size bucket (default: on "
        "with --device cuda and the triton backend, where they run; --no-cuda-graphs: eager)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the device computes this one (default: on with "
        "--device cuda, off on the CPU; the tokens are the same either way)",
    )
    g.add_argument(
        "--fixed-threads",
        action="store_true",
        help="CPU: run torch's thread count (OMP_NUM_THREADS) in every step; by default a step "
        "runs fewer while other processes keep cores busy (the tokens are the same either way)",
    )
    g.add_argument(
        "--weights",
        default="float",
        help="float (in --dtype, the reference; default); int8 / int4: weight-only quantized, "
        "GGUF Q8_0 / Q4_1 blocks on pagedkv's kernels (int4 of a Q4_1 GGUF computes the fp32 "
        "model exactly), torch's int kernels where those do not load; int8-bf16 / int4-bf16: "
        "torch's int kernels with bf16 activations (fast with AMX or AVX512-BF16, rounding "
        "differently). The kernel is chosen by rule, the same on every start, and printed",
    )
    g.add_argument(
        "--policy",
        default="vllm",
        help="paging policy: vllm (paged 16), sglang (radix 1), trtllm (paged 64), llamacpp, "
        "deepinfer (paged 128), reserved (contiguous max_model_len), or paged:B / radix:B",
    )
    g.add_argument("--block-size", type=int, help="tokens per block (default: the policy's)")
    add_prefix_match_unit_arg(g)
    g.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        help="KV pool size, e.g. 4GiB (default: 512MiB on the CPU; on a GPU what "
        "--gpu-memory-utilization leaves once the weights and the largest step are in)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        metavar="F",
        help="GPU: the fraction of the card's memory this engine may use, weights, activations "
        "and KV pool together (%(default)s, as vLLM); two engines on one card give theirs each",
    )
    # The scheduler's limits: SchedulerConfig owns their defaults (sched/limits.py).
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="running sequences at most (%(default)s)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="tokens per step; longer prompts run in chunks (%(default)s)",
    )
    g.add_argument("--max-model-len", type=int, help="context length (default min(model, 2048))")
    g.add_argument(
        "--host-kv-memory",
        default="0",
        metavar="SIZE",
        help="host tier for evicted prefix blocks, e.g. 2GiB (LRU; default 0 = none)",
    )
    g.add_argument(
        "--kv-store",
        metavar="redis://HOST:PORT",
        help="shared KV store: full blocks written through to Redis and read back on a miss "
        "(other engines on the same store share prefixes); down or slow = recompute",
    )
    g.add_argument(
        "--kv-events",
        metavar="redis://HOST:PORT",
        help="publish the prefix cache's changes (blocks stored / removed, per step) to the "
        "Redis stream pagedkv:kv-events:<instance id>, for a prefix-aware router "
        "(GET /pagedkv/info names it; docs/kv_events.md); Redis down = events dropped and "
        "counted, a snapshot once it answers",
    )
    add_swap_args(g)


def add_prefix_match_unit_arg(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """``--prefix-match-unit``: the engine's, the simulator's and the planner's."""
    g.add_argument(
        "--prefix-match-unit",
        type=int,
        metavar="U",
        help="tokens a prefix match counts in; U divides the block size (default: the block "
        "size, whole blocks; trtllm: 1). Below it, a prefix ending inside a block reuses its "
        "matched tokens: copied into a fresh block, or the block claimed when unused",
    )


def add_tensor_parallel_arg(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``: the engine's, the profiler's."""
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (rank 0 schedules and serves; N - 1 workers): "
        "query and KV heads, MLP rows and vocabulary split; gloo on the CPU (each rank its "
        "share of the cores), NCCL on GPUs (one a rank). N must divide the query heads and "
        "divide or be a multiple of the KV heads (default 1; docs/tensor_parallel.md)",
    )


def add_placement_args(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--attention-backend``: where and how the model runs."""
    g.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda[:N]",
        help="auto (default): a GPU when torch sees one, else the CPU",
    )
    g.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        help="activations, weights and KV (default: float32 on the CPU, bfloat16 on a GPU)",
    )
    g.add_argument(
        "--attention-backend",
        choices=[*RULES, *ALIASES],
        metavar="|".join(RULES),
        help="native: pagedkv's C kernels (the CPU default); triton: pagedkv's Triton kernels "
        "(the GPU default; on the CPU Triton's interpreter, for tests); torch-sdpa: torch SDPA "
        "over gathered K/V (the reference, any device). 'torch' (the old name) still works",
    )


def add_swap_args(g: argparse._ArgumentGroup) -> None:
    """``--preemption-mode`` and ``--swap-space``: the engine's and the simulator's."""
    g.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default=SchedulerConfig.preemption_mode,
        help="a victim's KV is freed and recomputed, or swapped to host memory (%(default)s)",
    )
    g.add_argument(
        "--swap-space",
        metavar="SIZE",
        help="host swap space for --preemption-mode swap, e.g. 2GiB (4GiB, as vLLM)",
    )


def swap_space_bytes(args: argparse.Namespace) -> int:
    """--swap-space, or vLLM's default of 4 GiB when swapping without one (0 otherwise: a
    --swap-space under recompute is passed on, for the config to refuse)."""
    if args.swap_space:
        return parse_bytes("--swap-space", args.swap_space)
    return 4 * 2**30 if args.preemption_mode == "swap" else 0


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens per sample")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, help="per-request seed (sample i uses seed + i)")
    g.add_argument("-n", type=int, default=1, help="samples per prompt (forked, copy-on-write)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    g.add_argument("--logprobs", type=int, help="report the chosen token's logprob and N top")


def engine_config(args: argparse.Namespace, **overrides):
    from pagedkv.engine import EngineConfig

    fields = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
        adapt_threads=not args.fixed_threads,
        weights=args.weights,
        policy=args.policy,
        block_size=args.block_size,
        prefix_match_unit=args.prefix_match_unit,
        kv_cache_memory_bytes=(
            None
            if args.kv_cache_memory is None
            else parse_bytes("--kv-cache-memory", args.kv_cache_memory, minimum=1)
        ),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        host_kv_memory_bytes=parse_bytes("--host-kv-memory", args.host_kv_memory),
        kv_store=args.kv_store,
        kv_events_url=args.kv_events,
        preemption_mode=args.preemption_mode,
        swap_space_bytes=swap_space_bytes(args),
        tensor_parallel_size=args.tensor_parallel_size,
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def sampling_params(args: argparse.Namespace):
    from pagedkv.engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        n=args.n,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def print_stats(stats, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in stats.rows():
        table.add_row(label, value)
    Console(stderr=True).print(table)
