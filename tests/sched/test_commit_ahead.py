"""``Scheduler.commit_ahead``: a step scheduled before the previous one's tokens are drawn (an
asynchronous engine's loop, ``engine/step/loop.py``) finishes every request with the tokens of the
synchronous loop, on every allocator, under recompute and swap preemption, with stop tokens,
``max_new_tokens`` and ``n > 1`` forks; the invariants hold after every half step; the prefix
cache never hashes a placeholder."""

from __future__ import annotations

import random

import pytest

from pagedkv.kvcache import build_allocator
from pagedkv.kvcache.policies import get_policy
from pagedkv.sched import ScheduledBatch, Scheduler, SchedulerConfig, Seq
from pagedkv.sched.sequence import PLACEHOLDER


def next_token(seq: Seq, sample_index: int = 0) -> int:
    """A token that depends only on the sequence's known tokens (what a synchronous engine
    has when it draws), so recomputation and scheduling ahead draw the same."""
    known = seq.token_ids[: seq.num_known_tokens]
    return (sum(known[-3:]) * 31 + len(known) + 7 * sample_index) % 97 + 1000


def draws(batch: ScheduledBatch) -> list[list[int]]:
    return [[] if s.seq.is_finished else [next_token(s.seq, k) for k in range(s.num_samples)]
            for s in batch.seqs]  # fmt: skip


def workload(sched: Scheduler) -> None:
    rng = random.Random(1)
    for i in range(8):
        prompt = [rng.randrange(900) for _ in range(rng.randrange(3, 30))]
        sched.add_request(f"r{i}", prompt, max_new_tokens=rng.randrange(1, 25),
                          stop_token_ids=(1000 + i,), n=3 if i == 5 else 1)  # fmt: skip


def build(policy: str, block_size: int | None, mode: str, num_slots: int) -> Scheduler:
    alloc = build_allocator(get_policy(policy), num_slots, 64, block_size)
    swap = 96 if mode == "swap" else 0
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64,
                             preemption_mode=mode, swap_space_slots=swap)  # fmt: skip
    return config.build(alloc)


def finished_tokens(done: list[Seq]) -> dict[int, list[int]]:
    return {s.seq_id: list(s.token_ids) for s in done}


def run_sync(sched: Scheduler) -> dict:
    done: list[Seq] = []
    while sched.has_unfinished():
        batch = sched.schedule()
        done += sched.update(batch, draws(batch)).finished
        sched.check_invariants()
    return finished_tokens(done)


def run_ahead(sched: Scheduler) -> tuple[dict, int]:
    """schedule N + 1 and commit it ahead, then draw and update N: the engine's order."""
    done: list[Seq] = []
    prev: ScheduledBatch | None = None
    ahead = 0
    while sched.has_unfinished() or prev is not None:
        batch = sched.schedule()
        if batch.seqs:
            sched.commit_ahead(batch)
            ahead += sum(item.seq.has_placeholder for item in batch.seqs)
        sched.check_invariants()
        if prev is not None:
            done += sched.update(prev, draws(prev)).finished
            sched.check_invariants()
        prev = batch if batch.seqs else None
    for seq in done:
        assert PLACEHOLDER not in seq.token_ids and not seq.has_placeholder
    return finished_tokens(done), ahead


CASES = [("vllm", 4, 200), ("vllm", 1, 120), ("sglang", None, 120), ("radix:4", None, 160),
         ("reserved", None, 256), ("llamacpp", None, 200)]  # fmt: skip


@pytest.mark.parametrize("policy, block_size, num_slots", CASES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_ahead_finishes_with_the_synchronous_tokens(policy, block_size, num_slots, mode):
    sync = build(policy, block_size, mode, num_slots)
    workload(sync)
    want = run_sync(sync)
    ahead = build(policy, block_size, mode, num_slots)
    workload(ahead)
    got, num_ahead = run_ahead(ahead)
    assert got == want and num_ahead > 0
    assert len(want) == 10  # 8 requests, one of them n = 3


def test_a_placeholder_is_written_in_order_and_never_hashed():
    sched = build("vllm", 4, "recompute", 200)
    seq = sched.add_request("a", [5, 6, 7], max_new_tokens=8)
    first = sched.schedule()
    sched.commit_ahead(first)  # draws token 4: scheduled ahead as a placeholder
    assert seq.num_known_tokens == 3 and seq.token_ids[3] == PLACEHOLDER
    second = sched.schedule()  # computes the placeholder, fills the first block
    assert second.seqs[0].num_new_tokens == 1
    sched.commit_ahead(second)
    assert seq.num_tokens == 5 and seq.num_known_tokens == 3
    assert len(sched.allocator.prefix_hashes()) == 0  # block 0 holds a placeholder yet
    sched.update(first, [[11]])
    assert list(seq.token_ids[:4]) == [5, 6, 7, 11] and seq.num_known_tokens == 4
    assert len(sched.allocator.prefix_hashes()) == 1  # known now: hashed
    sched.update(second, [[12]])
    assert list(seq.token_ids) == [5, 6, 7, 11, 12] and not seq.has_placeholder
