"""The workloads of ``bench_engine.py`` that are about batching (not latency): throughput of a
fixed batch, the paging overhead, the pool's capacity, and the trace-driven workload."""

from __future__ import annotations

import csv
import random
import statistics
import time
from functools import partial
from pathlib import Path

from common import medians, ratios, round_order
from engine_peers import engine_on, run_hf_continuous, run_hf_static, run_pagedkv
from pagedkv.engine import LLMEngine, SamplingParams
from pagedkv.traces import require_shared_trace

AZURE_CONV = "azure_llm_2023_conv.csv"


def azure_workload(
    count: int, vocab: int, path: Path | None = None, scale: int = 4, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """The first ``count`` Azure conversation requests, lengths divided by ``scale`` and clipped
    to prompts of 16-768 and outputs of 8-256 tokens (the model's 2k context); prompt token ids
    drawn at random (fixed seed): every engine is fed the same ids. ``path`` defaults to the
    shared trace (``pagedkv.traces.require_shared_trace``: UsageError when it is not here)."""
    path = path or require_shared_trace(AZURE_CONV)
    rng = random.Random(seed)
    ids, outs = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(ids) == count:
                break
            prompt = min(max(int(row["ContextTokens"]) // scale, 16), 768)
            outs.append(min(max(int(row["GeneratedTokens"]) // scale, 8), 256))
            ids.append([rng.randrange(100, vocab) for _ in range(prompt)])
    return ids, outs


TOPICS = ["the ocean", "a lighthouse", "compilers", "bread", "winter", "a violin", "trains",
          "the moon", "gardening", "chess", "volcanoes", "libraries", "bees", "rain", "maps",
          "glass"]  # fmt: skip


def prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts of varied length (about 10 to 60 tokens), as token ids."""
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Write a short essay about {topic}. " + "Be specific and vivid. " * (i % 6)
        out.append(tokenizer.encode(text))
    return out


def bench_throughput(
    loaded, hf, repeats: int, num_prompts: int, new_tokens: int, dtype: str = "float32"
) -> dict:
    """Ours and the peers on the same weights at ``dtype``, alternating (``round_order``);
    medians and ratios."""
    tokenizer = loaded[2]
    ids = prompts(tokenizer, num_prompts)
    pad_id = tokenizer.eos_token_id or 0
    peers = {"transformers generate (padded)": partial(run_hf_static, batch_size=len(ids))}
    if hasattr(hf, "generate_batch"):
        peers["transformers generate_batch (continuous)"] = run_hf_continuous
    outs = [new_tokens] * len(ids)
    calls = {"pagedkv": lambda: run_pagedkv(loaded, ids, outs, dtype=dtype),
             **{k: partial(fn, hf, ids, outs, pad_id=pad_id) for k, fn in peers.items()}}  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        for name in round_order(list(calls), r):
            try:
                secs, toks = calls[name]()
            except Exception as exc:  # a peer API that does not run on CPU is reported, not fatal
                if name == "pagedkv":
                    raise
                print(f"{name} failed: {exc!r}")
                continue
            rates[name].append(toks / secs)
    med = medians(rates)
    return {"tokens_per_s": med, "ratio": ratios(med, "pagedkv")}


def decode_step_times(engine: LLMEngine, ids, new_tokens: int) -> float:
    """Median wall time of the steps in which every scheduled sequence decodes one token."""
    for p in ids:
        engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        batch_size_before = engine.snapshot().num_running_seqs
        engine.step()
        if batch_size_before == len(ids):  # all prompts computed: a pure decode step
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_paging_overhead(loaded, repeats: int, num_seqs: int, new_tokens: int) -> dict:
    ids = prompts(loaded[2], num_seqs)
    step: dict[str, list[float]] = {"paged B=16": [], "reserved": []}
    for r in range(repeats):
        for name, policy in round_order((("paged B=16", "vllm"), ("reserved", "reserved")), r):
            # 640 tokens: a reserved region each (28 MiB) so that 1 GiB holds all 16 at once.
            engine = engine_on(loaded, policy=policy, kv_cache_memory_bytes=1 << 30,
                               max_model_len=640)  # fmt: skip
            step[name].append(decode_step_times(engine, ids, new_tokens))
    med = {k: v * 1e3 for k, v in medians(step).items()}
    return {"decode_step_ms": med, "paged_over_reserved": med["paged B=16"] / med["reserved"]}


def bench_capacity(loaded, num_requests: int) -> dict:
    tokenizer = loaded[2]
    ids = [tokenizer.encode("Summarise: " + "lorem ipsum dolor sit amet " * (2 + 7 * (i % 8)))
           for i in range(num_requests)]  # fmt: skip
    params = [SamplingParams(max_tokens=8 + 8 * (i % 4), ignore_eos=True) for i in range(len(ids))]
    out = {}
    for policy in ("reserved", "vllm"):
        # 64 MiB holds two reserved regions of 640 tokens (the longest prompt: 515).
        engine = engine_on(loaded, policy=policy, kv_cache_memory_bytes=64 << 20,
                           max_model_len=640)  # fmt: skip
        engine.generate(ids, params)
        s = engine.stats()
        out[policy] = {"peak_running": s.peak_running, "steps": s.num_steps,
                       "kv_utilization_peak": round(s.kv_utilization_peak, 3)}  # fmt: skip
    out["prompt_tokens"] = [len(p) for p in ids]
    return out
