"""n > 1 by forking, and the scheduler unchanged over every allocator preset."""

from __future__ import annotations

import random

import pytest

from pagedkv.kvcache import PagedAllocator
from pagedkv.kvcache.policies import POLICIES, build_allocator
from pagedkv.sched import FinishReason, Scheduler
from tests.sched.helpers import next_token, run_to_completion, step


def test_n_samples_fork_after_the_prompt_with_copy_on_write_tail() -> None:
    alloc = PagedAllocator(20, 4)
    sched = Scheduler(alloc)
    parent = sched.add_request("r", range(1, 7), max_new_tokens=3, n=3)  # 6 tokens: 1.5 blocks
    b1 = sched.schedule()
    assert [(s.num_new_tokens, s.num_samples) for s in b1.seqs] == [(6, 3)]
    assert sched.update(b1, [[10, 11, 12]]).finished == []
    alloc.check_invariants()
    p, c1, c2 = sched.running
    assert p is parent and c1.parent is parent and c2.parent is parent
    assert [s.output_token_ids for s in (p, c1, c2)] == [[10], [11], [12]]
    assert all(s.num_computed_tokens == 6 and s.request_id == "r" for s in (c1, c2))
    # One full block shared by all three, one private tail each.
    assert alloc.stats().num_used_blocks == 4
    assert alloc.block_table(c1)[0] == alloc.block_table(p)[0]

    b2, _ = step(sched)
    tail = alloc.block_table(p)[1]
    assert sorted(b2.block_copies) == sorted(
        [(tail, alloc.block_table(c1)[1]), (tail, alloc.block_table(c2)[1])]
    )
    assert [(s.num_computed_tokens, s.num_new_tokens, s.num_samples) for s in b2.seqs] == [
        (6, 1, 1)
    ] * 3
    done = run_to_completion(sched)
    assert sorted(s.seq_id for s in done) == sorted(s.seq_id for s in (p, c1, c2))
    assert all(s.num_output_tokens == 3 for s in done)
    assert alloc.stats().num_used_blocks == 0


def test_fork_without_a_free_block_recomputes_the_child() -> None:
    # 3 usable blocks: enough for both samples of "r" (1 shared + 1 own each), but "a" holds
    # the third one when "r" forks, so the child finds no block for its tail copy.
    alloc = PagedAllocator(4, 4)
    sched = Scheduler(alloc)
    sched.add_request("r", range(1, 7), max_new_tokens=2, n=2)
    sched.add_request("a", range(1, 5), max_new_tokens=1)
    b1 = sched.schedule()
    assert alloc.stats().num_used_blocks == 3
    sched.update(b1, [[10, 11], [12]])
    alloc.check_invariants()
    (child,) = sched.waiting
    assert child.num_computed_tokens == 0 and child.output_token_ids == [11]
    done = run_to_completion(sched)
    assert sorted(s.num_output_tokens for s in done if s.request_id == "r") == [2, 2]


def test_n_samples_that_can_never_be_resident_together_are_refused() -> None:
    # 6-token prompt + 2 new = 8 tokens in blocks of 4: one shared full block plus one own
    # block per sample. n = 2 needs 1 + 2 = 3 blocks: a pool of 2 can never hold them.
    sched = Scheduler(PagedAllocator(3, 4))
    seq = sched.add_request("r", range(1, 7), max_new_tokens=2, n=2)
    assert seq.finish_reason is FinishReason.REFUSED and "3 KV blocks" in seq.finish_detail
    ok = sched.add_request("s", range(1, 7), max_new_tokens=2, n=1)  # 2 blocks: fits
    assert not ok.is_finished
    refusal = sched.refusal(6, 2, n=2)
    assert refusal is not None and refusal.param == "n" and refusal.code == "kv_pool_too_small"


def test_a_child_that_samples_a_stop_token_finishes_without_blocks() -> None:
    sched = Scheduler(PagedAllocator(20, 4))
    sched.add_request("r", range(1, 7), max_new_tokens=5, n=2, stop_token_ids=[0])
    b1 = sched.schedule()
    (child,) = sched.update(b1, [[10, 0]]).finished
    assert child.finish_reason is FinishReason.STOP and child.output_token_ids == [0]
    assert sched.num_running == 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_a_mixed_workload_to_completion(policy: str) -> None:
    rng = random.Random(7)
    system = [rng.randrange(1, 500) for _ in range(20)]  # a shared prefix
    alloc = build_allocator(policy, num_slots=1024, max_model_len=128)
    sched = Scheduler(alloc, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128)
    expected: dict[str, int] = {}
    for i in range(14):
        prompt = system + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))]
        n = 2 if i % 5 == 0 else 1
        max_new = rng.randrange(1, 30)
        sched.add_request(f"r{i}", prompt, max_new_tokens=max_new, n=n)
        expected[f"r{i}"] = max_new
    done = run_to_completion(sched)
    assert len(done) == 14 + 3  # three requests with n = 2
    assert all(s.num_output_tokens == expected[s.request_id] for s in done)
    stats = alloc.stats()
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0


def test_tokens_follow_the_sequence_not_the_schedule() -> None:
    """The helper's token rule depends on the sequence only: the premise of the equivalence
    test between preempted and unpreempted runs."""
    sched = Scheduler(PagedAllocator(9, 4))
    seq = sched.add_request("a", [3, 4, 5], max_new_tokens=1)
    assert next_token(seq) == next_token(seq)
    assert next_token(seq, 1) != next_token(seq, 0)


def test_update_finishes_samples_the_caller_stopped_and_reports_forks() -> None:
    alloc = PagedAllocator(20, 4)
    sched = Scheduler(alloc)
    parent = sched.add_request("r", range(1, 7), max_new_tokens=5, n=3)
    b1 = sched.schedule()
    done = sched.update(b1, [[10, 11, 12]], stopped=[[False, False, True]])
    alloc.check_invariants()
    assert [(f.parent, f.sample_offset) for f in done.forked] == [(parent, 1), (parent, 2)]
    first, second = (f.child for f in done.forked)
    # Draw 2 ended on a stop string: its child finished at once, holding no block.
    assert done.finished == [second] and second.finish_reason is FinishReason.STOP
    assert second.output_token_ids == [12] and not first.is_finished
    b2 = sched.schedule()
    assert {item.seq for item in b2.seqs} == {parent, first}
    stops = [[item.seq is parent] for item in b2.seqs]
    done = sched.update(b2, [[20] for _ in b2.seqs], stopped=stops)
    assert done.finished == [parent] and parent.finish_reason is FinishReason.STOP
    assert parent.output_token_ids == [10, 20] and done.forked == []
    alloc.check_invariants()
    run_to_completion(sched)
    assert alloc.stats().num_used_blocks == 0
