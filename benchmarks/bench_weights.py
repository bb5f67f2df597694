"""The weight options (``--weights float|int8|int4``) against each other, in one process: the
embedded SmolLM2-135M loaded once per option, decode steps and TTFT alternating, medians.

"chosen" is what a user gets: each projection shape served by whichever of pagedkv's native
block kernel, torch's int kernel (fp32 or bf16 activations) and the float path won a one-row
timing at load (``quant.py``). "torch" takes torch's int kernel with bf16 activations for
every shape, whatever it timed (the path before the native block kernels). Also printed: the load's per-shape table, and
how many layers kept the one-call native decode layer (it needs every projection native).

Nothing is asserted; docs/latency.md quotes a run.

    python benchmarks/bench_weights.py [--threads 2] [--batch-sizes 1,4,32] [--repeats 5]
        [--kinds int4,int8]
"""

from __future__ import annotations

import argparse
import functools

import torch

import pagedkv.model.loader as loader
from bench_native import alternate
from common import ratios
from engine_peers import run_pagedkv
from pagedkv.model import load_model
from pagedkv.model.quant import QuantizingFactory
from profile_step import decoding_engine


def load_options(kinds: list[str]) -> dict[str, tuple]:
    """``{"float": loaded, "int4 chosen": loaded, "int4 torch": loaded, ...}``."""
    loaded = {"float": load_model(None, progress=False)}
    chosen = loader.QuantizingFactory
    for kind in kinds:
        loaded[f"{kind} chosen"] = load_model(None, progress=False, weights=kind)
        loader.QuantizingFactory = functools.partial(QuantizingFactory, force="bfloat16")
        try:
            loaded[f"{kind} torch"] = load_model(None, progress=False, weights=kind)
        finally:
            loader.QuantizingFactory = chosen
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", default="int4,int8", help="quantized options to compare")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_options(args.kinds.split(","))
    print(f"threads {args.threads}, cpu {torch.backends.cpu.get_cpu_capability()}\n")
    for name, (_, model, _) in loaded.items():
        fused = sum(layer.all_native() for layer in model.layers)
        print(f"{name}: one-call decode layers {fused}/{len(model.layers)}")
        if name.endswith("chosen"):
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
