"""``PrefixIndex`` against hand-built event streams and against live allocators."""

from __future__ import annotations

import random

from pagedkv.kvcache import PagedAllocator
from pagedkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from pagedkv.routing import PrefixIndex, prompt_block_hashes
from tests.kvcache.conftest import Seq, admit

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def test_match_counts_leading_blocks_per_replica():
    ix = PrefixIndex()
    ix.apply("r0", [BlockStored((A, B, C), None, 16)])
    ix.apply("r1", [BlockStored((A,), None, 16), BlockStored((C,), B, 16)])  # holds A, C: not B
    assert ix.match([A, B, C, D]) == {"r0": 3, "r1": 1}
    assert ix.match([B, C]) == {"r0": 2}
    assert ix.match([D, A]) == {}
    assert ix.match([]) == {}


def test_media_count_separately_and_clear_drops_all():
    ix = PrefixIndex()
    ix.apply("r0", [BlockStored((A, B), None, 16), BlockStored((B,), A, 16, medium="host")])
    ix.apply("r0", [BlockRemoved((B,))])  # still on the host
    assert ix.match([A, B]) == {"r0": 2}
    ix.apply("r0", [BlockRemoved((B,), medium="host")])
    assert ix.match([A, B]) == {"r0": 1}
    ix.apply("r0", [BlockRemoved((D,))])  # unknown hash: ignored
    ix.apply("r0", [AllBlocksCleared()])
    assert ix.match([A]) == {} and ix.num_blocks("r0") == 0


def test_drop_replica_forgets_only_that_replica():
    ix = PrefixIndex()
    ix.apply("r0", [BlockStored((A, B), None, 16)])
    ix.apply("r1", [BlockStored((A,), None, 16)])
    ix.drop_replica("r0")
    assert ix.match([A, B]) == {"r1": 1} and ix.replicas() == ["r1"]


def test_index_follows_live_allocators_and_matches_their_own_prefix_match():
    """Three allocators under random traffic over shared stems: after every operation the index
    holds exactly each one's cached hashes, and its match equals each allocator's own
    ``match_prefix`` (in blocks) for a fresh prompt."""
    rng = random.Random(3)
    stems = [[rng.randrange(1000) for _ in range(40)] for _ in range(4)]
    allocs = {f"r{i}": PagedAllocator(20, 8) for i in range(3)}
    logs = {}
    for name, alloc in allocs.items():
        logs[name] = KVEventLog()
        alloc.enable_events(logs[name])
    ix = PrefixIndex()
    live: dict[str, list[Seq]] = {n: [] for n in allocs}
    for step in range(300):
        name = rng.choice(list(allocs))
        alloc = allocs[name]
        if live[name] and (rng.random() < 0.5 or alloc.num_allocatable_blocks < 8):
            alloc.free(live[name].pop(rng.randrange(len(live[name]))))
        else:
            tokens = rng.choice(stems)[: rng.randrange(8, 41)] + [2000 + step] * rng.randrange(9)
            seq = Seq(step, tokens)
            hit = alloc.match_prefix(seq)
            if alloc.allocate(seq, len(tokens) - hit, num_cached_tokens=hit):
                live[name].append(seq)
        ix.apply(name, logs[name].drain())
        for n, a in allocs.items():
            assert ix.holds(n) == a.prefix_hashes()
        probe = Seq(10_000 + step, rng.choice(stems) + [1])
        got = ix.match(prompt_block_hashes(probe.token_ids, 8))
        want = {n: a.match_prefix(probe) // 8 for n, a in allocs.items()}
        assert got == {n: m for n, m in want.items() if m}


def test_prompt_block_hashes_leave_out_the_last_token():
    tokens = list(range(33))
    assert len(prompt_block_hashes(tokens, 16)) == 2
    assert len(prompt_block_hashes(tokens[:32], 16)) == 1  # token 31 is always recomputed
    alloc, log = PagedAllocator(8, 16), KVEventLog()
    alloc.enable_events(log)
    admit(alloc, Seq(1, tokens))
    (stored,) = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert list(stored.block_hashes) == prompt_block_hashes(tokens, 16)


def test_match_tokens_scores_the_partial_block_a_replica_holds():
    """Two replicas of partial-reuse allocators (B = 8): both cached the same first block; r0
    also a block after it whose first 5 tokens the request shares, r1 one sharing 2. A
    replica without token ids is scored on whole blocks."""
    stem = list(range(100, 113))
    logs = {}
    for name, tail in (("r0", [1, 2, 3]), ("r1", [50, 51, 52, 53, 54, 55])):
        alloc = PagedAllocator(16, 8, prefix_match_unit=1)
        logs[name] = KVEventLog()
        alloc.enable_events(logs[name])
        prompt = stem[:8] + (stem[8:] if name == "r0" else stem[8:10]) + tail
        admit(alloc, Seq(1, prompt))
    whole = PagedAllocator(16, 8)  # r2: whole blocks, no token ids in its events
    logs["r2"] = KVEventLog()
    whole.enable_events(logs["r2"])
    admit(whole, Seq(1, stem + [1, 2, 3]))
    ix = PrefixIndex()
    for name, log in logs.items():
        ix.apply(name, log.drain())
    request = stem + [9, 9, 9]
    hashes = prompt_block_hashes(request, 8)
    assert ix.match(hashes) == {"r0": 1, "r1": 1, "r2": 1}
    assert ix.match_tokens(hashes, request, 8) == {"r0": 13, "r1": 10, "r2": 8}
    ix.apply("r0", [BlockRemoved(tuple(whole.prefix_hashes()))])  # the same chain: r0 forgets it
    assert "r0" not in ix.match_tokens(hashes, request, 8)
    ix.apply("r1", [AllBlocksCleared()])
    assert "r1" not in ix.match_tokens(hashes, request, 8)
