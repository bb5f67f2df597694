"""``pk_linear`` of another build of pagedkv's kernels (a previous commit's library) against this
checkout's, in one process: the 121 projection matrices of the embedded model's shapes (random
fp32, 538 MB, so nothing stays in cache) at each ``--rows``, alternating, medians of
``--repeats``, the rate at which the weights are read. Nothing is asserted; docs/latency.md
(tenth round) quotes a run.

The other library: build it from a checkout of that commit and pass its path, e.g.

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before/src python -c "from pagedkv.model import native; print(native.kernels()._name)"
    python benchmarks/bench_kernel_ab.py --before <that path> [--rows 1,2,4,8,9,16,32,64]
"""

from __future__ import annotations

import argparse
import ctypes

import torch

from common import alternate_s, machine_line, machine_meta, medians
from pagedkv.model import native

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (in, out), 30 layers
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def load_before(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.pk_linear.argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _INT]
    lib.pk_set_isa.argtypes = [_INT]
    lib.pk_set_isa(1 if native.isa() == "avx512" else 0)  # the form this process runs
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="path of the other native_kernels-*.so")
    parser.add_argument("--rows", default="1,2,4,8,9,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    now = native.kernels()
    if now is None:
        raise SystemExit(
            f"error: the native kernels are unavailable: {native.unavailable_reason()}"
        )
    try:
        before = load_before(args.before)
    except (OSError, AttributeError) as err:
        raise SystemExit(f"error: --before {args.before}: {err}") from None
    weights = [torch.randn(n, k) for k, n in SHAPES]
    mb = sum(w.numel() * 4 for w in weights) / 1e6
    print(f"{machine_line(machine_meta())}; threads {args.threads}, ISA {native.isa()}\n")
    print("| rows | before | now | now faster |\n|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        ys = [torch.empty(rows, w.shape[0]) for w in weights]

        def run(lib, xs=xs, ys=ys, rows=rows):
            for w, y in zip(weights, ys, strict=True):
                n, k = w.shape
                lib.pk_linear(
                    xs[k].data_ptr(), w.data_ptr(), None, None, y.data_ptr(), rows, k, n,
                    args.threads,
                )  # fmt: skip

        med = medians(
            alternate_s({"before": lambda: run(before), "now": lambda: run(now)}, args.repeats)
        )
        b, a = med["before"] * 1e3, med["now"] * 1e3
        print(
            f"| {rows} | {b:.1f} ms ({mb / b:.1f} GB/s) | {a:.1f} ms ({mb / a:.1f} GB/s) | {b / a:.2f}x |"
        )


if __name__ == "__main__":
    main()
