"""pagedkv's own kernels (``native.py``) against the torch path they replace, in one process:
the embedded SmolLM2-135M loaded twice, once with the kernels and once without
(``native.set_enabled(False)``: ``projection.Projection``, torch's RMSNorm, SDPA over gathered
contexts), runs alternating, medians.

1. kernels: every projection matrix of the model (121, 538 MB) at ``--rows`` rows, both ways,
   and the rate at which each reads the weights (up to 64 rows, ``pk_linear``) or multiplies
   (above, ``pk_gemm`` against MKL), beside a ``torch.sum`` of the same tensors;
2. decode steps of the real engine at ``--batch-sizes`` (one token for each of B sequences);
3. time to first token of a 256-token prompt.

Nothing is asserted; docs/latency.md quotes a run.

    python benchmarks/bench_native.py [--threads 2] [--rows 1,4,16,64] [--batch-sizes 1,4,32]
        [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from common import alternate_s, medians
from engine_peers import run_pagedkv
from pagedkv.model import load_model, native
from pagedkv.model.native.projection import NativeProjection
from pagedkv.model.projection import Projection
from profile_step import decoding_engine


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeats`` times after one warm-up
    (``common.alternate_s``: the order flips every round)."""
    return medians(alternate_s(fns, repeats))


def bench_kernels(ours, theirs, rows: int, repeats: int) -> str:
    natives = [m for m in ours.modules() if isinstance(m, NativeProjection)]
    plains = [m for m in theirs.modules() if isinstance(m, Projection)]
    inputs = {p.in_features: torch.randn(rows, p.in_features) for p in natives}
    mb = sum(p.weight.numel() * 4 for p in natives) / 1e6
    med = alternate(
        {
            "native": lambda: [p(inputs[p.in_features]) for p in natives],
            "torch": lambda: [p(inputs[p.in_features]) for p in plains],
            "sum": lambda: [p.weight.sum() for p in natives],
        },
        repeats,
    )
    ms = {k: v * 1e3 for k, v in med.items()}
    # Up to MAX_ROWS the products are memory-bound (GB/s of weights), above compute-bound.
    gflop = 2 * rows * mb / 4 / 1e3
    rate = (lambda t: f"{mb / t:.1f} GB/s") if rows <= native.MAX_ROWS else (
        lambda t: f"{gflop / t * 1e3:.0f} GFLOPS")  # fmt: skip
    return (f"| {rows} | {ms['native']:.2f} ms ({rate(ms['native'])}) | "
            f"{ms['torch']:.2f} ms ({rate(ms['torch'])}) | {ms['torch'] / ms['native']:.2f}x "
            f"| {ms['sum']:.2f} ms ({mb / ms['sum']:.1f} GB/s) |")  # fmt: skip


def bench_steps(loaded, batch_size: int, repeats: int) -> str:
    engines = {name: decoding_engine(m, batch_size, 12 * repeats) for name, m in loaded.items()}
    med = alternate({name: e.step for name, e in engines.items()}, repeats * 5)
    ours, theirs = med["native"] * 1e3, med["torch"] * 1e3
    return f"| {batch_size} | {ours:.1f} ms | {theirs:.1f} ms | {theirs / ours:.2f}x |"


def bench_ttft(loaded, repeats: int) -> str:
    tokenizer = loaded["native"][2]
    ids = [tokenizer.encode("The history of the lighthouse. " * 64)[:256]]
    med = alternate({n: lambda m=m: run_pagedkv(m, ids, [1]) for n, m in loaded.items()}, repeats)
    ours, theirs = med["native"] * 1e3, med["torch"] * 1e3
    return f"| TTFT, 256-token prompt | {ours:.1f} ms | {theirs:.1f} ms | {theirs / ours:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.kernels() is None:
        raise SystemExit(f"the native kernels are unavailable: {native.unavailable_reason()}")
    loaded = {"native": load_model(None, progress=False)}
    native.set_enabled(False)
    loaded["torch"] = load_model(None, progress=False)
    native.set_enabled(True)
    print(f"threads {args.threads}, cpu {torch.backends.cpu.get_cpu_capability()}\n")
    print("| rows | native | torch (sharded bmm / mm) | native faster | torch.sum |")
    print("|---:|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        print(bench_kernels(loaded["native"][1], loaded["torch"][1], rows, args.repeats))
    print("\n| decode batch | native step | torch step | native faster |\n|---:|---:|---:|---:|")
    for batch_size in map(int, args.batch_sizes.split(",")):
        print(bench_steps(loaded, batch_size, args.repeats))
    print("\n| | native | torch | native faster |\n|---|---:|---:|---:|")
    print(bench_ttft(loaded, args.repeats))


if __name__ == "__main__":
    main()
