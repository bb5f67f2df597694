"""Where one engine step goes, on the embedded SmolLM2-135M: batch 1 and batch 32.

For each batch size the engine first prefills the prompts, then times ``--steps`` pure decode
steps three ways: wall time per step, cProfile (Python: which functions, cumulative), and the
torch profiler (operators: matmuls vs attention vs the rest). It also prints the memory-bound
floor of a decode step: the bytes of the weights read once per step over the measured read
bandwidth. Nothing is asserted; docs/latency.md has the before and after pictures.

``--context N`` gives every sequence a prompt of N token ids instead of the short text one,
for decode steps whose attention reads long contexts (the pool sized to hold them all).

    python benchmarks/profile_step.py [--batch-sizes 1,32] [--steps 20] [--threads 2]
        [--weights float|int8|int4] [--context 1000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from common import decode_weight_bytes, read_bandwidth_gb_s
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.profiling import kv_record_bytes
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model

PROMPT = "Write a short essay about the ocean. Be specific and vivid."


def decoding_engine(loaded, batch_size: int, steps: int, context: int = 0) -> LLMEngine:
    """An engine with ``batch_size`` requests whose prompts are computed: every later step
    decodes one token for each of them. ``context``: prompts of that many (seeded random)
    token ids, the pool sized for every sequence to run at once; 0: the short text prompt."""
    params = SamplingParams(max_tokens=steps * 4 + 8, ignore_eos=True)
    config = EngineConfig(log_startup=False, max_model_len=1024, max_num_seqs=batch_size)
    if context:
        seq_tokens = context + params.max_tokens + 16
        record_bytes = kv_record_bytes(loaded[0], "float32")
        config = EngineConfig(
            log_startup=False, max_model_len=seq_tokens, max_num_seqs=batch_size,
            kv_cache_memory_bytes=batch_size * (seq_tokens + 16) * record_bytes,
        )  # fmt: skip
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    gen = torch.Generator().manual_seed(0)
    for i in range(batch_size):
        ids = torch.randint(100, loaded[2].vocab_size, (context,), generator=gen).tolist()
        engine.add_request(ids if context else f"{PROMPT} ({i})", params)
    while True:  # until a step computes one token for each of the batch: prompts all done
        before = engine.stats().computed_tokens
        engine.step()
        if engine.stats().computed_tokens - before == batch_size:
            break
    return engine


def profile(loaded, batch_size: int, steps: int, context: int = 0) -> None:
    engine = decoding_engine(loaded, batch_size, steps, context)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    where = f", contexts of {context}+ tokens" if context else ""
    print(f"\n## batch {batch_size}{where}: median decode step {statistics.median(walls) * 1e3:.1f} ms "
          f"({batch_size / statistics.median(walls):.1f} tok/s)")  # fmt: skip

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
    print("\n### cProfile (cumulative, top 18)\n```\n" + out.getvalue().strip() + "\n```")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            engine.step()
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print("\n### torch operators (self CPU time, top 15)\n```\n" + table + "\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="float", help="float, int8 or int4")
    parser.add_argument(
        "--context", type=int, default=0,
        help="prompts of this many token ids (decode over long contexts); 0: a short text",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, progress=False, weights=args.weights)
    weight_bytes = decode_weight_bytes(loaded[1])  # a row of the embedding table per token
    bandwidth = read_bandwidth_gb_s()
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    print(f"weights {args.weights}: {weight_bytes / 1e6:.0f} MB read per step; read bandwidth "
          f"{bandwidth:.1f} GB/s; "
          f"memory-bound floor of a decode step ~{floor_ms:.1f} ms")  # fmt: skip
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        profile(loaded, batch_size, args.steps, args.context)


if __name__ == "__main__":
    main()
