"""`pagedkv demo`: the main demo (`make run`) on the embedded model.

A batch of chat requests that share one system prompt runs as one continuous batch on a small
KV pool; the first answer streams to the terminal while the others run beside it. The same
batch then runs again on the same pool under the `reserved` policy (one contiguous
max_model_len region per request), and a table shows what paging saved: concurrent sequences,
blocks, prefix hits and speed.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pagedkv.commands.busy_machine import warn_if_busy
from pagedkv.commands.engine_flags import add_engine_args, engine_config, print_stats
from pagedkv.commands.progress import BatchProgress
from pagedkv.errors import UsageError

if TYPE_CHECKING:  # torch: imported once the flags are checked
    from rich.console import Console

    from pagedkv.engine import EngineConfig, SamplingParams
    from pagedkv.engine.stats import EngineInfo, EngineStats

SYSTEM_PROMPT = (
    "You are a concise assistant for a team that builds LLM inference engines. Answer in two "
    "or three plain sentences, name concrete numbers when you know them, and say so when you "
    "are unsure. Never use lists or headings."
)
QUESTIONS = [
    "What is a KV cache?",
    "Why do inference engines split memory into blocks?",
    "What is continuous batching?",
    "Why does a shared system prompt save memory?",
    "What limits how many requests a GPU can serve at once?",
    "What is copy-on-write?",
    "Why is decoding slower per token than prefill?",
    "What does a block table map?",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the main demo: a shared-system-prompt batch, paged vs reserved",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per answer")
    p.add_argument("--num-requests", type=int, default=8, help=f"at most {len(QUESTIONS)}")
    add_engine_args(p)
    p.set_defaults(func=run, kv_cache_memory="48MiB", max_model_len=512)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pagedkv.engine import SamplingParams
    from pagedkv.engine.pool_plan import engine_placement
    from pagedkv.model.loader import load_model

    if not 1 <= args.num_requests <= len(QUESTIONS):
        raise UsageError(f"--num-requests must be in [1, {len(QUESTIONS)}]", "--num-requests")
    console = Console(stderr=True)
    params = SamplingParams(max_tokens=args.max_tokens)  # flags checked before the load
    # The same device, backend and pool: the reserved baseline's block is one max_model_len
    # region, which every attention backend reads (Triton's tiles gather through the table).
    configs = {
        args.policy: engine_config(args),
        "reserved": engine_config(args, policy="reserved", prefix_match_unit=None),
    }
    placement = engine_placement(configs[args.policy])
    warn_if_busy("demo", adapts=not args.fixed_threads, device=args.device)
    loaded = None  # under tensor parallelism each engine's ranks load their shares
    if args.tensor_parallel_size == 1:
        loaded = load_model(
            args.model, placement.dtype, weights=args.weights, device=placement.device
        )
    results = {}
    for policy, config in configs.items():
        results[policy] = _run_batch(args, policy, config, loaded, params, console)
    _print_savings(results, args.policy, console)
    return 0


def _run_batch(
    args: argparse.Namespace,
    policy: str,
    config: EngineConfig,
    loaded: tuple | None,
    params: SamplingParams,
    console: Console,
) -> tuple[EngineStats, EngineInfo]:
    """Run the chat batch on a fresh engine of ``config`` (streaming the first answer under
    ``--policy``), print its stats; returns them with the engine's info."""
    from pagedkv.engine import LLMEngine
    from pagedkv.engine.startup import build_parts

    engine = LLMEngine(config, parts=build_parts(config, loaded))
    prompts = [
        engine.tokenizer.encode_chat(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        )
        for q in QUESTIONS[: args.num_requests]
    ]
    ids = [engine.add_request(p, params) for p in prompts]
    streamed = policy == args.policy
    if streamed:
        console.rule(f"[bold]{QUESTIONS[0]}")
    printed, streaming = 0, streamed
    progress = BatchProgress(len(ids), f"pagedkv demo, policy {policy}", "requests")
    while engine.has_unfinished():
        outputs = engine.step()
        for out in outputs:
            if streaming and out.request_id == ids[0]:
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
                if out.finished:  # the answer's line is complete: progress may follow
                    sys.stdout.write("\n")
                    streaming = False
        progress.update(outputs, quiet=streaming)  # never inside the streamed answer
    stats = engine.stats()
    engine.close()
    print_stats(stats, title=f"{len(prompts)} chat requests — policy {policy}")
    return stats, engine.info


def _print_savings(
    results: dict[str, tuple[EngineStats, EngineInfo]], policy: str, console: Console
) -> None:
    """The table of what ``policy`` saved against ``reserved`` on the same pool."""
    from rich.table import Table

    table = Table(title="what paging saves on the same KV pool")
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")
    (paged, paged_info), (reserved, _) = results[policy], results["reserved"]
    for label, get in [
        ("block size (tokens)", lambda s, info: f"{info.block_size}"),
        ("peak running sequences", lambda s, p: f"{s.peak_running}"),
        ("steps to finish the batch", lambda s, p: f"{s.num_steps}"),
        ("prefix-hit tokens", lambda s, p: f"{s.prefix_hit_tokens}"),
        ("KV utilization peak", lambda s, p: f"{s.kv_utilization_peak:.1%}"),
        ("generated tokens/s", lambda s, p: f"{s.generated_tokens_per_s:.1f}"),
    ]:
        table.add_row(label, *(get(s, p) for s, p in results.values()))
    console.print(table)
    console.print(
        f"Same {paged_info.kv_cache_bytes / 2**20:.0f} MiB pool: {policy} ran "
        f"{paged.peak_running} requests at once, reserved {reserved.peak_running}."
    )
