"""pagedkv's KV events beside vLLM's, on one workload, in one process.

Both KV managers (pagedkv's ``PagedAllocator``, vLLM's ``KVCacheManager`` with
``enable_kv_cache_events``) get the same operations: admit a prompt (prefix lookup, then
allocation), grow running sequences by decode tokens, free them, on a pool small enough that
cached prefixes are evicted all the time. After every operation each side's events are
replayed into the set of prefixes it says it holds, and the two sets are compared.

The hashes differ (each side has its own hash of the tokens), so a block is named by its whole
token prefix: ours through ``prompt_block_hashes`` of the sequences we sent, vLLM's through its
events (``BlockStored`` carries ``token_ids`` and ``parent_block_hash``). vLLM reports per block
(two blocks computed with the same prefix are stored, and removed, twice); pagedkv per hash; a
vLLM prefix counts as held while any of its blocks is. Also compared: the prefix hit of every
admission. Runs in the peer venv (``make bench-peers``):

    .venv-peers/bin/python benchmarks/compare_kv_events.py [--ops 3000] [--seed 0] [--block-sizes 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the peer venv lacks it

from pagedkv.kvcache import PagedAllocator  # noqa: E402
from pagedkv.kvcache.events import KVEventLog, replay  # noqa: E402
from pagedkv.routing import prompt_block_hashes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kvcache import Vllm  # noqa: E402
from common import write_json  # noqa: E402


class Seq:
    def __init__(self, seq_id: int, tokens: list[int]) -> None:
        self.seq_id, self.token_ids = seq_id, tokens
        from pagedkv.kvcache import NO_EXTRA_KEYS

        self.extra_keys = NO_EXTRA_KEYS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-sizes", default="1,16,64")
    ap.add_argument("--blocks", type=int, default=64, help="pool size in blocks (both sides)")
    ap.add_argument("--out", default="results/compare_kv_events.json")
    a = ap.parse_args()
    peer = Vllm()
    runs = [compare(peer, int(b), a.ops, a.seed, a.blocks) for b in a.block_sizes.split(",")]
    write_json(a.out, runs)  # a list, one record per block size (docs/kv_events.md cites it)
    print(json.dumps(runs, indent=2))


def compare(peer: Vllm, bs: int, num_ops: int, seed: int, num_blocks: int) -> dict:
    """One workload of ``num_ops`` operations at block size ``bs`` on both sides."""
    rng = random.Random(seed)
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    cfg = peer._config(num_blocks + 1, [], [peer._group(["layer0"], peer._spec(bs))])  # +1: null
    theirs = peer._manager(cfg, 1 << 16, scheduler_block_size=bs, hash_block_size=bs,
                           enable_kv_cache_events=True)  # fmt: skip
    hasher = peer._hasher(bs)
    ours, log = PagedAllocator(num_blocks + 1, bs), KVEventLog()
    ours.enable_events(log)

    stems = [[rng.randrange(1, 30000) for _ in range(8 * bs)] for _ in range(6)]
    our_prefix: dict[bytes, tuple] = {}  # our hash -> token prefix
    vllm_prefix: dict[int, tuple] = {}  # vLLM hash -> token prefix
    our_held: set[bytes] = set()
    vllm_held: Counter = Counter()
    live: dict[int, tuple[Seq, object]] = {}
    counts = Counter()
    mismatches: list[dict] = []

    def name_ours(tokens: list[int]) -> None:
        for i, h in enumerate(prompt_block_hashes(tokens + [0], bs)):
            our_prefix.setdefault(h, tuple(tokens[: (i + 1) * bs]))

    def drain() -> None:
        replay(log.drain(), our_held)
        for ev in theirs.take_events():
            if isinstance(ev, BlockStored):
                prefix = vllm_prefix.get(ev.parent_block_hash, ()) if ev.parent_block_hash else ()
                for j, h in enumerate(ev.block_hashes):
                    prefix = prefix + tuple(ev.token_ids[j * bs : (j + 1) * bs])
                    vllm_prefix[h] = prefix
                    vllm_held[h] += 1
                counts["vllm_stored_blocks"] += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    vllm_held[h] -= 1
                    if vllm_held[h] <= 0:
                        del vllm_held[h]
                counts["vllm_removed_blocks"] += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                vllm_held.clear()

    for op in range(num_ops):
        if live and (rng.random() < 0.35 or len(live) > 6):
            sid = rng.choice(list(live))
            seq, req = live.pop(sid)
            ours.free(seq)
            theirs.free(req)
            counts["frees"] += 1
        elif live and rng.random() < 0.5:
            sid = rng.choice(list(live))
            seq, req = live[sid]
            n = rng.randrange(1, 2 * bs)
            new = [rng.randrange(1, 30000) for _ in range(n)]
            if ours.num_allocatable_blocks < n // bs + 2:
                continue
            for t in new:
                seq.token_ids.append(t)
                assert ours.allocate(seq, 1)
                req.append_output_token_ids(t)
                assert theirs.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
            name_ours(seq.token_ids)
            counts["decode_tokens"] += n
        else:
            tokens = rng.choice(stems)[: rng.randrange(bs, 8 * bs)]
            tokens = tokens + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 3 * bs))]
            seq, req = Seq(op, list(tokens)), peer._req(op, list(tokens), hasher)
            hit = ours.match_prefix(seq)
            if not ours.allocate(seq, len(tokens) - hit, num_cached_tokens=hit):
                continue
            blocks, vhit, *_ = theirs.get_computed_blocks(req)
            got = theirs.allocate_slots(req, len(tokens) - vhit, vhit, blocks)
            if got is None:
                ours.free(seq)
                counts["vllm_refused_admission"] += 1
                continue
            req.num_computed_tokens = len(tokens)
            counts["admissions"] += 1
            counts["hit_tokens_ours"] += hit
            counts["hit_tokens_vllm"] += vhit
            if hit != vhit:
                counts["admissions_hit_differs"] += 1
            name_ours(seq.token_ids)
            live[op] = (seq, req)
        drain()
        mine = {our_prefix[h] for h in our_held}
        peer_held = {vllm_prefix[h] for h in vllm_held}
        counts["compared_states"] += 1
        if mine != peer_held:
            counts["states_differ"] += 1
            if len(mismatches) < 5:
                mismatches.append({"op": op, "only_pagedkv": len(mine - peer_held),
                                   "only_vllm": len(peer_held - mine)})  # fmt: skip
    counts["our_stored_blocks"], counts["our_removed_blocks"] = (
        log.num_stored_blocks, log.num_removed_blocks)  # fmt: skip
    return {"vllm": peer.version, "block_size": bs, "pool_blocks": num_blocks, "ops": num_ops,
            "seed": seed, "counts": dict(counts), "first_mismatches": mismatches}  # fmt: skip


if __name__ == "__main__":
    main()
