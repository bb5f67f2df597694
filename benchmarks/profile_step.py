"""Where one engine step goes, on the embedded SmolLM2-135M: batch 1 and batch 32.

For each batch size the engine first prefills the prompts, then times ``--steps`` pure decode
steps three ways: wall time per step, cProfile (Python: which functions, cumulative), and the
torch profiler (operators: matmuls vs attention vs the rest). It also prints the memory-bound
floor of a decode step: the bytes of the weights read once per step over the measured read
bandwidth. Nothing is asserted; docs/latency.md has the before and after pictures.

    python benchmarks/profile_step.py [--batch-sizes 1,32] [--steps 20] [--threads 2]
        [--weights float|int8|int4]
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
from pagedkv.engine.startup import build_parts
from pagedkv.model import load_model

PROMPT = "Write a short essay about the ocean. Be specific and vivid."


def decoding_engine(loaded, batch_size: int, steps: int) -> LLMEngine:
    """An engine with ``batch_size`` requests whose prompts are computed: every later step
    decodes one token for each of them."""
    config = EngineConfig(log_startup=False, max_model_len=1024, max_num_seqs=batch_size)
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    params = SamplingParams(max_tokens=steps * 4 + 8, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"{PROMPT} ({i})", params)
    while engine.snapshot().num_waiting_seqs or engine.stats().generated_tokens < batch_size:
        engine.step()
    return engine


def profile(loaded, batch_size: int, steps: int) -> None:
    engine = decoding_engine(loaded, batch_size, steps)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    print(f"\n## batch {batch_size}: median decode step {statistics.median(walls) * 1e3:.1f} ms "
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
        profile(loaded, batch_size, args.steps)


if __name__ == "__main__":
    main()
