"""Where the trace workload's time goes: the 64 Azure conversation requests of
``bench_engine.py --sections trace`` (lengths / 4, all at t = 0) through one engine, each
forward pass timed and labelled by what its batch held: steps that carry prefill chunks vs
decode-only steps, with their batch sizes and longest context. ``--ops`` adds the torch
profiler's top operators over the whole run. Nothing is asserted; docs/latency.md quotes it.

    python benchmarks/profile_trace.py [--requests 64] [--threads 2] [--ops]
        [--dtype float32|bfloat16] [--weights float|int4|...] [--mkl]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine_peers import engine_on
from engine_workloads import azure_workload
from pagedkv.engine import SamplingParams
from pagedkv.model import load_model, native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", action="store_true", help="also the torch profiler's top ops")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--weights", default="float", help="a --weights option (default float)")
    parser.add_argument(
        "--mkl", action="store_true",
        help="products of more than 64 rows on MKL, not pagedkv's GEMM (the A/B of the ninth "
        "round in docs/latency.md)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native.set_gemm(not args.mkl)
    loaded = load_model(None, args.dtype, weights=args.weights, progress=False)
    ids, outs = azure_workload(args.requests, loaded[2].vocab_size)
    engine = engine_on(loaded, dtype=args.dtype)
    model = loaded[1]
    steps: list[tuple[float, int, int, int, int]] = []  # s, prefills, tokens, decodes, max ctx
    forward = model.forward

    def timed_forward(input_ids, positions, kv_caches, meta, *args, **kwargs):
        t0 = time.perf_counter()
        hidden = forward(input_ids, positions, kv_caches, meta, *args, **kwargs)
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        steps.append((time.perf_counter() - t0, int((q_lens > 1).sum()), int(q_lens.sum()),
                      int((q_lens == 1).sum()), int(meta.context_lens.max())))  # fmt: skip
        return hidden

    model.forward = timed_forward
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in outs]
    profiler = torch.profiler.profile() if args.ops else None
    t0 = time.perf_counter()
    if profiler is not None:
        with profiler:
            engine.generate(ids, params)
    else:
        engine.generate(ids, params)
    wall = time.perf_counter() - t0
    model.forward = forward
    mixed = [s for s in steps if s[1]]
    decode = [s for s in steps if not s[1]]
    print(f"{args.requests} requests, {sum(map(len, ids))} prompt and {sum(outs)} output tokens: "
          f"{wall:.1f} s wall, {sum(s[0] for s in steps):.1f} s in forward passes")  # fmt: skip
    print(f"\n{len(mixed)} steps with prefill chunks: {sum(s[0] for s in mixed):.1f} s")
    print(
        "| s | prefill seqs | tokens | decode seqs | longest context |\n|---:|---:|---:|---:|---:|"
    )
    for s in mixed:
        print(f"| {s[0]:.2f} | {s[1]} | {s[2]} | {s[3]} | {s[4]} |")
    print(f"\n{len(decode)} decode-only steps: {sum(s[0] for s in decode):.1f} s (every 10th)")
    print("| s | decode seqs | longest context |\n|---:|---:|---:|")
    for s in decode[::10]:
        print(f"| {s[0]:.3f} | {s[3]} | {s[4]} |")
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
