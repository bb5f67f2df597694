"""KV cache bookkeeping cost: what the allocator adds to every engine step, beside vLLM's.

Four rows per block size (1, 16, 128), default sha256 block hash on both sides:

* decode: microseconds per step for 256 running sequences (1,000-token prompts), each step
  appending one token to every sequence and growing its slots by one, over 200 steps so that
  block boundaries are crossed (hashing of newly full blocks included);
* admit: microseconds to admit a 2,000-token prompt whose first 1,200 tokens are cached
  (hashing the prompt, the prefix lookup and the allocation);
* free: microseconds to free a 2,000-token sequence;
* hash: full blocks hashed per second (a 64,000-token prompt).

The peer is vLLM's own ``KVCacheManager`` (``vllm.v1.core``), imported in the same process
when it is installed (``make bench-peers`` builds ``.venv-peers`` with it): both sides get the
same pool sizes and the same token ids, hashing is inside the timer on both sides, and the two
are measured alternately within each repeat (the order flips every repeat), so machine noise
hits both. pagedkv's decode also computes the new token's slot, which vLLM leaves to its model
runner: a handicap on our side. The garbage collector is paused during each measurement (after a
collection), on both sides. Each figure is the median over ``--repeats``; the ratio is
vLLM's median over ours (for hash: our rate over vLLM's), > 1 = pagedkv faster.

    python benchmarks/bench_kvcache.py [--repeats 5] [--block-sizes 1,16,128] [--rows free] [--no-peer]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the peer venv lacks it

from common import finish_meta, gc_paused, machine_meta, round_order, seconds, write_json
from pagedkv.kvcache import NO_EXTRA_KEYS, HashExtraKeys, PagedAllocator, hash_blocks, root_hash
from pagedkv.sched.sequence import TOKEN_TYPECODE

DECODE_SEQS, DECODE_PROMPT, DECODE_STEPS = 256, 1000, 200
ADMIT_PROMPT, ADMIT_CACHED, ADMIT_ROUNDS = 2000, 1200, 50
FREE_TOKENS, FREE_ROUNDS = 2000, 50
HASH_TOKENS = 64_000


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + t * 31) % 32000 for t in range(n)]


# -- pagedkv ---------------------------------------------------------------------------------


@dataclass
class Seq:
    """A sequence stored as the engine's ``sched.Seq`` stores it: token ids in an ``array`` of
    ``TOKEN_TYPECODE`` (vLLM's ``Request`` keeps a list; each side hashes its own storage)."""

    seq_id: int
    token_ids: array
    extra_keys: HashExtraKeys = field(default=NO_EXTRA_KEYS)

    def __post_init__(self) -> None:
        self.token_ids = array(TOKEN_TYPECODE, self.token_ids)


class Ours:
    name = "pagedkv"

    def decode(self, bs: int) -> float:
        alloc = PagedAllocator(DECODE_SEQS * ((DECODE_PROMPT + DECODE_STEPS) // bs + 2) + 2, bs)
        seqs = [Seq(i, prompt(i, DECODE_PROMPT)) for i in range(DECODE_SEQS)]
        for s in seqs:
            assert alloc.allocate(s, DECODE_PROMPT)

        def run() -> None:
            for step in range(DECODE_STEPS):
                n = DECODE_PROMPT + step
                for s in seqs:
                    s.token_ids.append(step)
                    alloc.allocate(s, 1)
                    alloc.slot_mapping(s, n, n + 1)

        return seconds(run) / DECODE_STEPS

    def admit(self, bs: int) -> float:
        alloc = PagedAllocator(8 * ADMIT_PROMPT // bs + 64, bs)
        warm = Seq(0, prompt(0, ADMIT_CACHED) + [1])
        assert alloc.allocate(warm, len(warm.token_ids))
        alloc.free(warm)
        times = []
        for r in range(1, ADMIT_ROUNDS + 1):
            s = Seq(r, prompt(0, ADMIT_CACHED) + prompt(r, ADMIT_PROMPT - ADMIT_CACHED))

            def run(s=s) -> None:
                hit = alloc.match_prefix(s)
                assert alloc.allocate(s, len(s.token_ids) - hit, num_cached_tokens=hit)

            times.append(seconds(run))
            assert alloc.num_tokens(s) == ADMIT_PROMPT
            assert alloc.stats().prefix_hit_tokens == r * (ADMIT_CACHED // bs) * bs
            alloc.free(s)
        return statistics.median(times)

    def free(self, bs: int) -> float:
        alloc = PagedAllocator(2 * FREE_TOKENS // bs + 8, bs)
        times = []
        for r in range(FREE_ROUNDS):
            s = Seq(r, prompt(r, FREE_TOKENS))
            assert alloc.allocate(s, FREE_TOKENS)
            times.append(seconds(alloc.free, s))
        return statistics.median(times)

    def hash_rate(self, bs: int) -> float:
        tokens = Seq(0, prompt(3, HASH_TOKENS)).token_ids  # built outside the timer, as vLLM's
        out: list = []
        t = seconds(lambda: out.extend(hash_blocks(tokens, bs, root_hash(NO_EXTRA_KEYS))))
        assert len(out) == HASH_TOKENS // bs
        return len(out) / t


# -- vLLM ------------------------------------------------------------------------------------


class Vllm:
    """vLLM's KVCacheManager driven as its scheduler drives it (see vllm/v1/core/sched)."""

    name = "vLLM"

    def __init__(self) -> None:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_manager, kv_cache_utils
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        self.version = vllm.__version__
        kv_cache_utils.init_none_hash(sha256)
        self._sha256, self._utils, self._request = sha256, kv_cache_utils, Request
        self._manager, self._params = kv_cache_manager.KVCacheManager, SamplingParams(max_tokens=1)
        self._spec = lambda bs: FullAttentionSpec(
            block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float16
        )
        self._config, self._group = KVCacheConfig, KVCacheGroupSpec

    def _new(self, num_blocks: int, bs: int):
        cfg = self._config(num_blocks, [], [self._group(["layer0"], self._spec(bs))])
        return self._manager(cfg, 1 << 20, scheduler_block_size=bs, hash_block_size=bs)

    def _hasher(self, bs: int):
        return self._utils.get_request_block_hasher(bs, self._sha256)

    def _req(self, rid: int, tokens: list[int], hasher=None):
        return self._request(str(rid), tokens, self._params, None, block_hasher=hasher)

    def decode(self, bs: int) -> float:
        # + 1: vLLM's null block is one of its num_blocks, as ours is.
        mgr = self._new(DECODE_SEQS * ((DECODE_PROMPT + DECODE_STEPS) // bs + 2) + 2, bs)
        hasher = self._hasher(bs)
        reqs = [self._req(i, prompt(i, DECODE_PROMPT), hasher) for i in range(DECODE_SEQS)]
        for r in reqs:
            assert mgr.allocate_slots(r, DECODE_PROMPT) is not None
            r.num_computed_tokens = DECODE_PROMPT

        def run() -> None:
            for step in range(DECODE_STEPS):
                for r in reqs:
                    r.append_output_token_ids(step)  # hashes a block that became full
                    mgr.allocate_slots(r, 1)
                    r.num_computed_tokens += 1

        return seconds(run) / DECODE_STEPS

    def admit(self, bs: int) -> float:
        mgr, hasher = self._new(8 * ADMIT_PROMPT // bs + 64, bs), self._hasher(bs)
        warm = self._req(0, prompt(0, ADMIT_CACHED) + [1], hasher)
        assert mgr.allocate_slots(warm, len(warm.all_token_ids)) is not None
        mgr.free(warm)
        times = []
        for i in range(1, ADMIT_ROUNDS + 1):
            r = self._req(i, prompt(0, ADMIT_CACHED) + prompt(i, ADMIT_PROMPT - ADMIT_CACHED))

            def run(r=r) -> None:
                r.block_hashes.extend(hasher(r))  # what Request() does with a hasher
                blocks, hit, _ = mgr.get_computed_blocks(r)
                assert mgr.allocate_slots(r, ADMIT_PROMPT - hit, hit, blocks) is not None

            times.append(seconds(run))
            assert len(mgr.get_block_ids(str(i))[0]) == -(-ADMIT_PROMPT // bs)
            mgr.free(r)
        return statistics.median(times)

    def free(self, bs: int) -> float:
        mgr, hasher = self._new(2 * FREE_TOKENS // bs + 8, bs), self._hasher(bs)
        times = []
        for i in range(FREE_ROUNDS):
            r = self._req(i, prompt(i, FREE_TOKENS), hasher)
            assert mgr.allocate_slots(r, FREE_TOKENS) is not None
            times.append(seconds(mgr.free, r))
        return statistics.median(times)

    def hash_rate(self, bs: int) -> float:
        r, hasher = self._req(0, prompt(3, HASH_TOKENS)), self._hasher(bs)
        out: list = []
        t = seconds(lambda: out.extend(hasher(r)))
        assert len(out) == HASH_TOKENS // bs
        return len(out) / t


def load_peer(wanted: bool):
    if not wanted:
        return None, "not run (--no-peer)"
    try:
        peer = Vllm()
    except ImportError as exc:
        return None, f"not installed ({exc}); `make bench-peers` builds a venv with it"
    return peer, f"vLLM {peer.version} KVCacheManager, same process, interleaved"


RATIO = "peer / pagedkv for times, pagedkv / peer for rates: > 1 = pagedkv faster"
METRICS = (
    ("decode_us", "decode", 1e6),
    ("admit_us", "admit", 1e6),
    ("free_us", "free", 1e6),
    ("hash_blocks_per_s", "hash_rate", 1.0),
)


def measure(sides, bs: int, repeats: int, only: set[str]) -> dict[str, list[list[float]]]:
    """{metric: [samples of side 0, samples of side 1, ...]}, sides alternating per repeat
    (``common.round_order``), the garbage collector paused in each measurement."""
    metrics = [m for m in METRICS if m[1].removesuffix("_rate") in only]
    out: dict[str, list[list[float]]] = {m: [[] for _ in sides] for m, _, _ in metrics}
    for rep in range(repeats):
        order = round_order(range(len(sides)), rep)
        for metric, method, scale in metrics:
            for i in order:
                with gc_paused():
                    out[metric][i].append(getattr(sides[i], method)(bs) * scale)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats per figure (median)")
    parser.add_argument("--block-sizes", default="1,16,128", help="comma list (default 1,16,128)")
    parser.add_argument("--rows", default="decode,admit,free,hash", help="comma list")
    parser.add_argument("--no-peer", action="store_true", help="time pagedkv alone")
    parser.add_argument("--out", type=Path, default=Path("results/bench_kvcache.json"))
    args = parser.parse_args()
    try:
        sizes = [int(b) for b in args.block_sizes.split(",")]
    except ValueError:
        parser.error(f"--block-sizes: expected integers like 1,16,128, got {args.block_sizes!r}")
    only = set(args.rows.split(","))
    if not only <= {"decode", "admit", "free", "hash"}:
        parser.error(f"--rows: a comma list of decode, admit, free, hash; got {args.rows!r}")
    if args.repeats < 1 or min(sizes) < 1:
        parser.error("--repeats and every block size must be >= 1")
    peer, peer_note = load_peer(not args.no_peer)
    # After the peer's import: torch's CPU capability, when it loaded torch.
    meta = machine_meta(repeats=args.repeats, peer=peer_note, ratio=RATIO)
    sides = [Ours()] + ([peer] if peer else [])
    rows = []
    for bs in sizes:
        for metric, samples in measure(sides, bs, args.repeats, only).items():
            med = [statistics.median(s) for s in samples]
            ours, theirs = med[0], (med[1] if peer else None)
            ratio = None
            if theirs is not None:
                ratio = ours / theirs if metric.endswith("_per_s") else theirs / ours
            rows.append(
                {
                    "metric": metric,
                    "block_size": bs,
                    "ours": round(ours, 2),
                    "peer": None if theirs is None else round(theirs, 2),
                    "ratio": None if ratio is None else round(ratio, 2),
                    "ours_samples": [round(x, 2) for x in samples[0]],
                    "peer_samples": [round(x, 2) for x in samples[1]] if peer else None,
                }
            )
            print(
                f"  B={bs:<4} {metric:<18} {rows[-1]['ours']:>12,} {rows[-1]['peer']}", flush=True
            )
    write_json(args.out, {"meta": finish_meta(meta), "rows": rows})
    print(f"\npeer: {peer_note}\n")
    print("| metric | B | pagedkv | vLLM | pagedkv faster by |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        peer_s = "–" if r["peer"] is None else f"{r['peer']:,.1f}"
        ratio_s = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        print(f"| {r['metric']} | {r['block_size']} | {r['ours']:,.1f} | {peer_s} | {ratio_s} |")


if __name__ == "__main__":
    main()
