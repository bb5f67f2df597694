"""Tensor parallelism on this CPU (issue 57): generated tokens/s of the embedded SmolLM2-135M
(fp32, greedy) at TP 1 (one process, 2 threads, and 1 thread) against TP 3 (3 processes, one
thread each: the model's 9 query and 3 KV heads allow 1, 3 and 9; TP 2 is refused) and, on a
tiny random Llama (4 query and 2 KV heads), TP 1 against TP 2, with the share of rank 0's
wall time spent in all-reduces (inside ``dist.all_reduce``: the transfer and the wait for the
slower rank).

Each engine's greedy ids are compared with TP 1's: how many of the batch's prompts match
exactly, and where the others first differ.

Every engine is built once; rounds alternate them (``common.alternate``, flipping the order),
each round one batch of requests; medians of the repeats. Nothing is asserted:
docs/tensor_parallel.md quotes a run.

    python benchmarks/bench_tp.py [--repeats 3] [--tokens 64] [--batch 8] [--out results/bench_tp.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import alternate, finish_meta, machine_meta, medians, ratios, write_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.model.tiny: the tiny random Llama

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain paging in one sentence.",
    "Why is the sky blue?",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Describe a cat in two sentences.",
    "What does a compiler do?",
]


def _engine(model: str | None, tp: int, threads: int):
    import torch

    from pagedkv.engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)  # TP > 1: each rank its share of it (one here)
    config = EngineConfig(
        model=model,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=128 << 20,
        adapt_threads=False,
        log_startup=False,
        max_model_len=512,
    )
    return LLMEngine(config)


def _run(engine, threads: int, prompts, params) -> dict:
    """One batch on ``threads`` (torch's count is the process's, each engine sets its own):
    tokens/s, and rank 0's all-reduce seconds and count (TP > 1), and each request's ids."""
    import torch

    group = engine.parts.ranks.group
    torch.set_num_threads(threads)
    if group is not None:
        group.timed, group.reduce_s, group.num_reduces = True, 0.0, 0
    steps = engine.stats().num_steps  # the engine's count so far
    started = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"tokens_per_s": tokens / wall, "wall_s": wall, "steps": engine.stats().num_steps - steps}
    row["ids"] = [list(o.outputs[0].token_ids) for o in outs]
    if group is not None:
        row.update(all_reduce_s=group.reduce_s, num_all_reduces=group.num_reduces)
    return row


def measure(label: str, model: str | None, sizes: list[int], args) -> dict:
    from pagedkv.engine import SamplingParams

    configs = {"TP 1": (1, 2), "TP 1, 1 thread": (1, 1), **{f"TP {n}": (n, 2) for n in sizes}}
    engines = {name: _engine(model, tp, threads) for name, (tp, threads) in configs.items()}
    try:
        tok = next(iter(engines.values())).tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        prompts = (prompts * -(-args.batch // len(prompts)))[: args.batch]
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        calls = {}
        for name, engine in engines.items():
            ranks = engine.parts.ranks
            threads = configs[name][1] if ranks.size == 1 else ranks.threads
            calls[name] = lambda e=engine, t=threads: _run(e, t, prompts, params)
        runs = alternate(calls, args.repeats, warmup=True)
    finally:
        for engine in engines.values():
            engine.close()
    greedy = _greedy_match({n: [r.pop("ids") for r in rs] for n, rs in runs.items()})
    rates = medians({n: [r["tokens_per_s"] for r in rs] for n, rs in runs.items()})
    share = {
        n: medians({n: [r["all_reduce_s"] / r["wall_s"] for r in rs]})[n]
        for n, rs in runs.items()
        if "all_reduce_s" in rs[0]
    }
    out = {
        "model": label,
        "tokens_per_s": rates,
        "vs_tp1": ratios(rates, "TP 1"),
        "all_reduce_share_of_wall": share,
        "greedy_vs_tp1": greedy,
        "runs": runs,
    }
    rounded = {n: round(v, 1) for n, v in rates.items()}
    shares = {n: f"{v:.1%}" for n, v in share.items()}
    exact = {n: f"{g['exact']}/{g['prompts']}" for n, g in greedy.items()}
    print(f"{label}: tokens/s {rounded}; all-reduce share {shares}; greedy = TP 1's {exact}")
    return out


def _greedy_match(ids: dict[str, list[list[list[int]]]]) -> dict[str, dict]:
    """Each engine's greedy ids against TP 1's (fp32, the same batch): how many of the prompts
    match exactly, and for each prompt the first new token that differs (None: equal); and
    whether every round of the engine gave the same ids."""
    want = ids["TP 1"][0]
    out = {}
    for name, rounds in ids.items():
        got = rounds[0]
        first = [_first_difference(g, w) for g, w in zip(got, want, strict=True)]
        out[name] = {
            "prompts": len(want),
            "exact": sum(f is None for f in first),
            "first_difference": first,
            "repeatable": all(r == got for r in rounds),
        }
    return out


def _first_difference(got: list[int], want: list[int]) -> int | None:
    """The index of the first new token where ``got`` and ``want`` differ; None if equal."""
    diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if diff is None and len(got) != len(want):
        return min(len(got), len(want))
    return diff


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="new tokens a request (64)")
    p.add_argument("--batch", type=int, default=8, help="requests a round (8)")
    p.add_argument("--out", default=str(HERE.parent / "results" / "bench_tp.json"))
    args = p.parse_args()
    meta = machine_meta(repeats=args.repeats, tokens=args.tokens, batch=args.batch)
    from tests.model.tiny import make_tiny_model

    tiny = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    make_tiny_model("llama", tiny, context_len=512)
    results = [
        measure("SmolLM2-135M-Instruct (embedded), fp32", None, [3], args),
        measure("tiny random Llama (2 layers, hidden 64)", str(tiny), [2], args),
    ]
    write_json(args.out, {"meta": finish_meta(meta), "results": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
