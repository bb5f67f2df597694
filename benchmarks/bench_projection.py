"""Does the column-sharded projection pay on this CPU? torch's ``mm`` vs one ``bmm`` over a
column shard per thread (``projection.Projection``, the torch path, taken where pagedkv's own
kernels do not load: this benchmark switches them off; ``bench_native.py`` compares the two),
interleaved, medians.

1. kernels: every projection matrix of the embedded SmolLM2-135M (121 of them, 538 MB) at
   ``--rows`` rows, both ways, and the rate at which each reads the weights;
2. engine: decode steps of the real engine at ``--batch-sizes``, with the sharded path on and
   off (``projection.SHARDED_MAX_ROWS``) in the same process.

Nothing is asserted; docs/latency.md quotes a run.

    python benchmarks/bench_projection.py [--threads 2] [--rows 1,4,16,64,256] [--batch-sizes 1,16]
"""

from __future__ import annotations

import argparse

import torch

import pagedkv.model.projection as projection
from common import alternate, median_s, medians
from pagedkv.model import load_model, native
from profile_step import decoding_engine


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after one warm-up (``common.median_s``)."""
    return median_s(fn, repeats) * 1e3


def bench_kernels(model, rows: int, repeats: int) -> str:
    projections = [m for m in model.modules() if isinstance(m, projection.Projection)]
    inputs = {p.in_features: torch.randn(rows, p.in_features) for p in projections}
    mb = sum(p.weight_t.numel() * p.weight_t.element_size() for p in projections) / 1e6

    def run(sharded: bool):
        def once():
            for p in projections:
                if sharded:
                    p._sharded(inputs[p.in_features])
                else:
                    inputs[p.in_features] @ p.weight_t

        return once

    # alternate, so that a slow moment hits both
    calls = {sharded: (lambda s=sharded: median_ms(run(s), 1)) for sharded in (False, True)}
    saved = projection.SHARDED_MAX_ROWS
    projection.SHARDED_MAX_ROWS = max(saved, rows)  # the shards at every row count measured
    try:
        med = medians(alternate(calls, repeats))
    finally:
        projection.SHARDED_MAX_ROWS = saved
    mm, bmm = med[False], med[True]
    return (f"| {rows} | {mm:.2f} ms ({mb / mm:.1f} GB/s) | {bmm:.2f} ms ({mb / bmm:.1f} GB/s) "
            f"| {mm / bmm:.2f}x |")  # fmt: skip


def bench_engine(loaded, batch_size: int, repeats: int) -> str:
    engine = decoding_engine(loaded, batch_size, 12 * repeats)
    saved = projection.SHARDED_MAX_ROWS

    def steps_ms(limit: int) -> float:
        projection.SHARDED_MAX_ROWS = limit
        return median_ms(engine.step, 5)

    try:
        med = medians(alternate({k: (lambda k=k: steps_ms(k)) for k in (0, saved)}, repeats))
    finally:
        projection.SHARDED_MAX_ROWS = saved
    mm, bmm = med[0], med[saved]
    return f"| {batch_size} | {mm:.1f} ms | {bmm:.1f} ms | {mm / bmm:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native.set_enabled(False)  # the torch Projection, sharded or not
    loaded = load_model(None, progress=False)
    print(f"{args.threads} threads, cpu {torch.backends.cpu.get_cpu_capability()}\n")
    print("| rows | mm | bmm, a shard a thread | speed-up |\n|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        print(bench_kernels(loaded[1], rows, args.repeats), flush=True)
    print("\n| decode batch | step, mm | step, sharded | speed-up |\n|---:|---:|---:|---:|")
    for batch_size in map(int, args.batch_sizes.split(",")):
        print(bench_engine(loaded, batch_size, args.repeats), flush=True)


if __name__ == "__main__":
    main()
