"""The prompt products (more than 64 rows) of the embedded model's four projection shapes, each
form side by side in one process, alternating, medians:

- ``fp32``: ``pk_gemm`` with spans of x sized by the L2 (the default);
- ``fp32 panel``: ``pk_gemm`` with one panel of 48 rows a span (``PAGEDKV_GEMM_SPAN_KB=1``, the
  form before spans: the weight read once per panel);
- ``int4``: ``pk_gemm_blocks`` on Q4_1 blocks, decoded a tile at a time (the default);
- ``int4 whole``: the whole matrix dequantized, then ``pk_gemm`` (the form before);
- ``mkl``: torch's ``mm`` on the fp32 weight.

int4 and fp32 multiply the same values (the weights are made Q4_1-exact), so every form but
MKL's gives the same bits (checked here once per shape). Nothing is asserted; docs/latency.md
quotes a run.

    python benchmarks/bench_gemm.py [--threads 2] [--rows 128,256,512,2048] [--repeats 9]
        [--out results/bench_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from common import alternate_s, finish_meta, machine_line, machine_meta, medians, ratios
from pagedkv.model import native
from pagedkv.model.native.projection import dense_product
from pagedkv.model.native.quant import NativeQuantProjection

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out): qkv, o, gate_up, down
SPAN = "PAGEDKV_GEMM_SPAN_KB"


def one_panel(fn):
    """``fn`` run with spans of one panel (restoring the caller's setting)."""

    def run():
        before = os.environ.get(SPAN)
        os.environ[SPAN] = "1"
        try:
            return fn()
        finally:
            os.environ.pop(SPAN) if before is None else os.environ.__setitem__(SPAN, before)

    return run


def forms(rows: int, k: int, n: int) -> dict:
    gen = torch.Generator().manual_seed(rows * n + k)
    blocks = NativeQuantProjection("q4_1", torch.randn(n, k, generator=gen) * 0.05, None)
    weight = blocks.dense_weight()  # Q4_1-exact: int4 and fp32 multiply the same values
    x = torch.randn(rows, k, generator=gen)
    fns = {
        "fp32": lambda: dense_product(x, weight, None),
        "fp32 panel": one_panel(lambda: dense_product(x, weight, None)),
        "int4": lambda: blocks(x),
        "int4 whole": one_panel(lambda: dense_product(x, blocks.dense_weight(), None)),
        "mkl": lambda: x @ weight.t(),
    }
    outs = {name: fn() for name, fn in fns.items() if name != "mkl"}
    if any(not torch.equal(y, outs["fp32"]) for y in outs.values()):
        raise SystemExit(f"the forms disagree at {rows} x {k} -> {n}: a bug, not a benchmark")
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="128,256,512,2048", help="rows of x (above 64)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, help="also write the medians (seconds) as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.gemm_kernels() is None:
        raise SystemExit(f"pagedkv's GEMM is unavailable: {native.unavailable_reason()}")
    meta = machine_meta(threads=args.threads)
    print(f"{machine_line(meta)}; threads {args.threads}, ISA {native.isa()}\n")
    names = ["fp32", "fp32 panel", "int4", "int4 whole", "mkl"]
    print("| rows | in -> out | " + " | ".join(names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    results = []
    for rows in map(int, args.rows.split(",")):
        for k, n in SHAPES:
            med = medians(alternate_s(forms(rows, k, n), args.repeats))
            faster = ratios(med, "fp32")
            gflops = 2 * rows * k * n / med["fp32"] / 1e9
            cells = [f"{med['fp32'] * 1e3:.2f} ms ({gflops:.0f} GFLOPS)"]
            cells += [f"{med[m] * 1e3:.2f} ms ({faster[m]:.2f}x)" for m in names[1:]]
            print(f"| {rows} | {k} -> {n} | " + " | ".join(cells) + " |")
            results.append({"rows": rows, "in": k, "out": n, "median_s": med})
    finish_meta(meta)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"\n(x: fp32's time over the form's, above 1 faster; load average after "
          f"{meta['load_avg_after']})")  # fmt: skip


if __name__ == "__main__":
    main()
