"""The CPU engine at two revisions, alternated: "is the CPU path unchanged in speed?"

Each revision is checked out in a git worktree of its own (the working tree itself for
``WORKTREE``); every round runs each revision in a fresh process, one after the other, so
both see the same machine: batch 1 (one prompt, ``--new-tokens`` tokens) and the trace (the
first 64 Azure conversation requests), the sections of ``bench_engine.py``, on the embedded
SmolLM2-135M in fp32 with ``--threads`` torch threads. It measures the process's CPU time, which
other jobs on a shared machine inflate far less than wall time (batch 1: the least of
``--batch1-repeats`` runs in the process, as its first run after the warm-up is 5-10 % slower and
that alone swung a 5-round median by 10 % here), and checks that both revisions produce the
same token ids. Reports per revision the rounds, their medians, the ratio
HEAD / BASE and the load average of each round. Nothing is asserted.

    python benchmarks/ab_revisions.py BASE [HEAD] [--rounds 3] [--threads 1] [--out FILE]

HEAD defaults to the working tree. A revision older than ``bench_engine.section_ids`` cannot
run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("batch1", "trace")


def child(tree: Path, threads: int, new_tokens: int, batch1_repeats: int) -> dict:
    """In a fresh process: ``tree``'s engine after a warm-up, batch 1 ``batch1_repeats`` times
    (the least CPU time kept), the trace once."""
    sys.path[:0] = [str(tree / "src"), str(tree / "benchmarks")]
    import torch

    torch.set_num_threads(threads)
    import bench_engine
    import engine_peers
    import pagedkv
    from pagedkv.model import load_model

    assert Path(pagedkv.__file__).is_relative_to(tree), pagedkv.__file__
    loaded = load_model(None, progress=False, weights="float")
    engine_peers.run_pagedkv_tokens(loaded, [[1, 2, 3]], [2])  # warm-up
    out: dict = {"load": os.getloadavg()[0]}
    for name in SECTIONS:
        ids, outs = bench_engine.section_ids(name, loaded[2], new_tokens, False)
        outs = [new_tokens] if name == "batch1" else outs
        runs = []
        for _ in range(batch1_repeats if name == "batch1" else 1):
            cpu0 = time.process_time()
            _, tokens = engine_peers.run_pagedkv_tokens(loaded, ids, outs)
            runs.append(time.process_time() - cpu0)
        out[name] = {"cpu_s": min(runs), "runs_s": runs, "tokens": sum(map(len, tokens)),
                     "md5": hashlib.md5(repr(tokens).encode()).hexdigest()}  # fmt: skip
    return out


def checkout(rev: str, into: Path) -> Path:
    if rev == "WORKTREE":
        return REPO
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)  # fmt: skip
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("base")
    p.add_argument("head", nargs="?", default="WORKTREE")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128, help="batch 1's output length")
    p.add_argument("--batch1-repeats", type=int, default=4, help="batch 1 runs per process")
    p.add_argument("--out", type=Path, help="JSON of every round")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads, args.new_tokens, args.batch1_repeats)))
        return 0
    runs: dict[str, list[dict]] = {args.base: [], args.head: []}
    with tempfile.TemporaryDirectory(prefix="pagedkv-ab-") as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for rev in runs}
        try:
            for r in range(args.rounds):
                for rev, tree in trees.items():
                    cmd = [sys.executable, __file__, rev, "--child", str(tree),
                           "--threads", str(args.threads), "--new-tokens", str(args.new_tokens),
                           "--batch1-repeats", str(args.batch1_repeats)]  # fmt: skip
                    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                    runs[rev].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(
                        f"round {r + 1} {rev}: "
                        + ", ".join(f"{s} {runs[rev][-1][s]['cpu_s']:.2f} s" for s in SECTIONS),
                        flush=True,
                    )
        finally:
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(tree)], capture_output=True)  # fmt: skip
    print(f"\n| section | {args.base} (s) | {args.head} (s) | median {args.head} / {args.base} "
          "| same tokens |\n|---|---|---|---|---|")  # fmt: skip
    for s in SECTIONS:
        a, b = ([x[s]["cpu_s"] for x in runs[rev]] for rev in (args.base, args.head))
        same = len({x[s]["md5"] for rev in runs for x in runs[rev]}) == 1
        print(f"| {s} | {' / '.join(f'{v:.2f}' for v in a)} | {' / '.join(f'{v:.2f}' for v in b)}"
              f" | {statistics.median(b) / statistics.median(a):.3f} | {same} |")  # fmt: skip
    loads = [round(x["load"], 2) for rev in runs for x in runs[rev]]
    print(f"\nload average at each run: {loads}; {args.threads} thread(s), process CPU time")
    if args.out:
        args.out.write_text(json.dumps({"rounds": runs, "threads": args.threads}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
