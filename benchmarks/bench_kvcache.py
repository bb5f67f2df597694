"""KV cache bookkeeping cost: what the allocator adds to every engine step.

Measures, for block sizes 1, 16 and 128 with the default (sha256) block hash:

* decode: microseconds of bookkeeping per step for 256 running sequences (1,000-token prompts),
  each step appending one token to every sequence (allocate + slot of the new token), over 200
  steps so that block boundaries are crossed;
* admit: microseconds to admit a 2,000-token prompt whose first 1,200 tokens are cached
  (match_prefix + allocate);
* free: microseconds to free a 2,000-token sequence;
* hash: full blocks hashed per second.

The peer is vLLM 0.33's KVCacheManager + BlockPool (sha256), measured on this kind of machine
(2 cores, CPython 3.11) and quoted in the issue; vLLM cannot be installed here without its CUDA
stack, so its figures are constants below, not a same-run measurement. Each figure is the median
of several repeats. Writes results/bench_kvcache.json and prints a markdown table.

    python benchmarks/bench_kvcache.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.kvcache import NO_EXTRA_KEYS, HashExtraKeys, PagedAllocator, hash_blocks, root_hash

# vLLM 0.33 on a 2-core machine, CPython 3.11 (from the issue). None: not quoted.
PEER_US = {
    ("decode", 16): 2000.0,
    ("decode", 1): 6500.0,
    ("admit", 16): 330.0,
    ("admit", 1): 4800.0,
    ("free", 16): 26.0,
}
PEER_HASH_BLOCKS_PER_S = 260_000.0


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    extra_keys: HashExtraKeys = field(default=NO_EXTRA_KEYS)


def bench_decode(block_size: int, num_seqs: int = 256, prompt_len: int = 1000, steps: int = 200):
    num_blocks = num_seqs * ((prompt_len + steps) // block_size + 2) + 2
    alloc = PagedAllocator(num_blocks, block_size)
    seqs = [Seq(i, [(i * 7919 + t) % 32000 for t in range(prompt_len)]) for i in range(num_seqs)]
    for s in seqs:
        assert alloc.allocate(s, prompt_len)
    per_step = []
    for step in range(steps):
        t0 = time.perf_counter()
        for s in seqs:
            s.token_ids.append(step)
            alloc.allocate(s, 1)
            alloc.slot_mapping(s, prompt_len + step, prompt_len + step + 1)
        per_step.append(time.perf_counter() - t0)
    alloc.check_invariants()
    return statistics.mean(per_step) * 1e6


def bench_admit(block_size: int, rounds: int = 50):
    alloc = PagedAllocator(8 * 2000 // block_size + 64, block_size)
    prefix = [(t * 31) % 32000 for t in range(1200)]
    warm = Seq(0, prefix + [1])
    assert alloc.allocate(warm, len(warm.token_ids))
    alloc.free(warm)
    times = []
    for r in range(1, rounds + 1):
        s = Seq(r, prefix + [(r * 1000 + t) % 32000 for t in range(800)])
        t0 = time.perf_counter()
        hit = alloc.match_prefix(s)
        ok = alloc.allocate(s, len(s.token_ids) - hit, num_cached_tokens=hit)
        times.append(time.perf_counter() - t0)
        assert ok and hit == (1200 // block_size) * block_size
        alloc.free(s)
    return statistics.median(times) * 1e6


def bench_free(block_size: int, rounds: int = 50):
    alloc = PagedAllocator(2 * 2000 // block_size + 8, block_size)
    times = []
    for r in range(rounds):
        s = Seq(r, [(r * 1000 + t) % 32000 for t in range(2000)])
        assert alloc.allocate(s, 2000)
        t0 = time.perf_counter()
        alloc.free(s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_hash(block_size: int, num_tokens: int = 64_000):
    tokens = [(t * 13) % 32000 for t in range(num_tokens)]
    root = root_hash(NO_EXTRA_KEYS)
    t0 = time.perf_counter()
    hashes = hash_blocks(tokens, block_size, root)
    return len(hashes) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats per figure (median)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_kvcache.json"))
    args = parser.parse_args()
    rows = []
    for bs in (1, 16, 128):
        med = {
            "decode": statistics.median(bench_decode(bs) for _ in range(args.repeats)),
            "admit": statistics.median(bench_admit(bs) for _ in range(args.repeats)),
            "free": statistics.median(bench_free(bs) for _ in range(args.repeats)),
        }
        hash_rate = statistics.median(bench_hash(bs) for _ in range(args.repeats))
        for name, us in med.items():
            peer = PEER_US.get((name, bs))
            rows.append(
                {
                    "metric": f"{name}_us",
                    "block_size": bs,
                    "ours": round(us, 2),
                    "peer": peer,
                    "speedup": round(peer / us, 2) if peer else None,
                }
            )
        peer_hash = PEER_HASH_BLOCKS_PER_S if bs == 16 else None
        rows.append(
            {
                "metric": "hash_blocks_per_s",
                "block_size": bs,
                "ours": round(hash_rate),
                "peer": peer_hash,
                "speedup": round(hash_rate / peer_hash, 2) if peer_hash else None,
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "repeats": args.repeats,
        "peer": "vLLM 0.33 KVCacheManager (quoted)",
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print("| metric | B | pagedkv | vLLM 0.33 (quoted) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        peer = "–" if r["peer"] is None else f"{r['peer']:,.0f}"
        sp = "–" if r["speedup"] is None else f"{r['speedup']:.1f}×"
        print(f"| {r['metric']} | {r['block_size']} | {r['ours']:,.1f} | {peer} | {sp} |")


if __name__ == "__main__":
    main()
