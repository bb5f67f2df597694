"""Threads on a shared machine (issue 28 item 3): the trace workload of ``bench_engine.py``
(the first ``--requests`` Azure conversation requests, lengths / 4, at t = 0, fp32) with each
OpenMP wait policy and thread count, on a quiet machine and beside one CPU-burning process:
every row at a fixed thread count (``EngineConfig.adapt_threads=False``) but the last, which is
pagedkv's default (2 threads at most, fewer while other processes hold cores:
``pagedkv/cpu_share.py``; spin count 10,000).

libgomp reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when it is loaded (at torch's
import), so every configuration runs in a fresh child process. Rounds alternate the
configurations; medians of output tok/s, the ratio to the default, and the load averages.
Nothing is asserted; docs/latency.md quotes a run.

    python benchmarks/bench_threads.py [--requests 32] [--repeats 2] [--burner both|on|off]
        [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import cpu_burner

HERE = Path(__file__).resolve().parent
ADAPTIVE = "GOMP_SPINCOUNT=10000, up to 2 threads, fewer beside busy cores (pagedkv's default)"
# (name, threads, extra environment): libgomp's default spins ~300k rounds before sleeping.
# The child imports torch before pagedkv, so pagedkv's own default (``pagedkv/__init__.py``)
# never applies here: each row is exactly its environment.
CONFIGS = [
    ("libgomp default, 2 threads", 2, {}),
    ("PASSIVE, 2 threads", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("GOMP_SPINCOUNT=10000, 2 threads", 2, {"GOMP_SPINCOUNT": "10000"}),
    ("GOMP_SPINCOUNT=1000, 2 threads", 2, {"GOMP_SPINCOUNT": "1000"}),
    ("libgomp default, 1 thread", 1, {}),
    # Each thread pinned to its core, as vLLM-CPU pins its OpenMP threads (THREADS_BIND).
    (
        "GOMP_SPINCOUNT=10000, OMP_PROC_BIND=close, 2 threads",
        2,
        {"GOMP_SPINCOUNT": "10000", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    ),
    (
        "PASSIVE, OMP_PROC_BIND=close, 2 threads",
        2,
        {"OMP_WAIT_POLICY": "PASSIVE", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    ),
    # pagedkv's default: its spin count and the thread count step by step.
    (ADAPTIVE, 2, {"GOMP_SPINCOUNT": "10000"}),
]


def child(requests: int, threads: int, adapt: bool) -> None:
    """In a fresh process: load, one warm-up of 4 requests, then the timed trace, the thread
    count fixed unless ``adapt``."""
    import torch

    from engine_peers import run_pagedkv
    from engine_workloads import azure_workload
    from pagedkv.model import load_model

    torch.set_num_threads(threads)
    loaded = load_model(None, progress=False)
    ids, outs = azure_workload(requests, loaded[2].vocab_size)
    run_pagedkv(loaded, ids[:4], [4] * 4, adapt_threads=adapt)
    elapsed, tokens = run_pagedkv(loaded, ids, outs, adapt_threads=adapt)
    print(json.dumps({"tok_s": tokens / elapsed, "s": elapsed}))


def run_config(requests: int, threads: int, env: dict[str, str], adapt: bool) -> float:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    full = {**full, **env, "OMP_NUM_THREADS": str(threads)}
    code = f"import bench_threads; bench_threads.child({requests}, {threads}, {adapt})"
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=full, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--burner", choices=("both", "on", "off"), default="both")
    parser.add_argument("--only", default="", help="run the configurations whose name has this")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if args.only in c[0]]
    conditions = ["off", "on"] if args.burner == "both" else [args.burner]
    results: dict[str, dict[str, list[float]]] = {
        c: {n: [] for n, _, _ in configs} for c in conditions
    }
    loads = []
    for condition in conditions:
        with cpu_burner(condition == "on"):
            for r in range(args.repeats):
                order = configs if r % 2 == 0 else configs[::-1]
                for name, threads, env in order:
                    tok_s = run_config(args.requests, threads, env, name == ADAPTIVE)
                    results[condition][name].append(tok_s)
                    loads.append((condition, name, os.getloadavg()))
                    print(f"burner {condition}, {name}: {results[condition][name][-1]:.1f} tok/s",
                          file=sys.stderr)  # fmt: skip
    print(f"\n{args.requests} trace requests, fp32, {args.repeats} rounds, {os.cpu_count()} CPUs")
    print(f"| burner | configuration | output tok/s (median) | vs {configs[0][0]} |")
    print("|---|---|---:|---:|")
    for condition in conditions:
        base = statistics.median(results[condition][configs[0][0]])
        for name, _, _ in configs:
            med = statistics.median(results[condition][name])
            print(f"| {condition} | {name} | {med:.1f} | {med / base:.2f}x |")
    print(
        "\nload averages after each run:", [(c, n, [round(x, 1) for x in la]) for c, n, la in loads]
    )


if __name__ == "__main__":
    main()
