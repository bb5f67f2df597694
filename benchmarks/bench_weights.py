"""The weight options (``--weights float|int8|int4|int8-bf16|int4-bf16``) against each
other, in one process: the embedded SmolLM2-135M loaded once per option, decode steps and TTFT
alternating, medians.

``int4`` / ``int8`` are the exact options (pagedkv's Q4_1 / Q8_0 block kernels wherever they
load); ``int4-bf16`` / ``int8-bf16`` take torch's int kernels with bf16 activations for every
shape (``quant.py``'s rule, the same on every start). Also printed: each load's per-shape table,
and how many layers kept the one-call native decode layer (it needs every projection native).

Nothing is asserted; docs/latency.md quotes a run.

    python benchmarks/bench_weights.py [--threads 2] [--batch-sizes 1,4,32] [--repeats 5]
        [--kinds int4,int8,int4-bf16,int8-bf16]
"""

from __future__ import annotations

import argparse

import torch

from bench_native import alternate
from common import ratios
from engine_peers import run_pagedkv
from pagedkv.model import load_model
from pagedkv.model.native.backend import chain_of
from profile_step import decoding_engine


def load_options(kinds: list[str]) -> dict[str, tuple]:
    """``{"float": loaded, "int4": loaded, "int4-bf16": loaded, ...}``."""
    loaded = {"float": load_model(None, progress=False)}
    for kind in kinds:
        loaded[kind] = load_model(None, progress=False, weights=kind)
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--kinds", default="int4,int8,int4-bf16,int8-bf16", help="quantized options to compare"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_options(args.kinds.split(","))
    print(f"threads {args.threads}, cpu {torch.backends.cpu.get_cpu_capability()}\n")
    for name, (_, model, _) in loaded.items():
        fused = sum(chain_of(layer) is not None for layer in model.layers)
        print(f"{name}: one-call decode layers {fused}/{len(model.layers)}")
        if name != "float":
            print("  " + model.weights_report.replace("\n", "\n  "))
    names = list(loaded)
    print("\n| decode batch | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for batch_size in map(int, args.batch_sizes.split(",")):
        engines = {n: decoding_engine(m, batch_size, 12 * args.repeats) for n, m in loaded.items()}
        med = alternate({n: e.step for n, e in engines.items()}, args.repeats * 5)
        faster = ratios(med, "float")
        cells = [f"{med[n] * 1e3:.1f} ms ({faster[n]:.2f}x)" for n in names]
        print(f"| {batch_size} | " + " | ".join(cells) + " |")
    ids = [loaded["float"][2].encode("The history of the lighthouse. " * 64)[:256]]
    med = alternate(
        {n: lambda m=m: run_pagedkv(m, ids, [1]) for n, m in loaded.items()}, args.repeats
    )
    faster = ratios(med, "float")
    cells = [f"{med[n] * 1e3:.0f} ms ({faster[n]:.2f}x)" for n in names]
    print("| TTFT(256) | " + " | ".join(cells) + " |")
    print("\n(x: the float path's time over the option's; above 1 is faster than float)")


if __name__ == "__main__":
    main()
