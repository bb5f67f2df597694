"""The scheduler step by step on hand-built sequences: budget, chunking, preemption, refusal."""

from __future__ import annotations

import pytest

from pagedkv.kvcache import PagedAllocator
from pagedkv.sched import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SequenceStatus,
    least_computed,
)
from tests.sched.helpers import run_to_completion, step


def rows(batch):
    """(request, computed before, new tokens, samples, prefix hit) for each scheduled entry."""
    return [
        (
            s.seq.request_id,
            s.num_computed_tokens,
            s.num_new_tokens,
            s.num_samples,
            s.prefix_hit_tokens,
        )
        for s in batch.seqs
    ]


def test_token_budget_chunks_prompts_and_serves_running_first() -> None:
    alloc = PagedAllocator(33, 4, prefix_caching=False)
    sched = Scheduler(alloc, max_num_seqs=8, max_num_batched_tokens=8)
    sched.add_request("A", range(1, 11), max_new_tokens=3)  # 10 prompt tokens
    sched.add_request("B", range(101, 107), max_new_tokens=3)  # 6 prompt tokens

    b1, _ = step(sched)  # A takes the whole budget: a chunk of 8, no logits yet
    assert rows(b1) == [("A", 0, 8, 0, 0)]
    assert sched.num_waiting == 1 and alloc.num_tokens(sched.running[0]) == 8

    b2, _ = step(sched)  # A's last 2 prompt tokens first, then B's whole prompt
    assert rows(b2) == [("A", 8, 2, 1, 0), ("B", 0, 6, 1, 0)]
    assert b2.num_batched_tokens == 8

    b3, _ = step(sched)  # both decode one token
    assert rows(b3) == [("A", 10, 1, 1, 0), ("B", 6, 1, 1, 0)]
    a, b = sched.running
    assert (a.num_output_tokens, b.num_output_tokens) == (2, 2)

    _, finished = step(sched)
    assert [s.request_id for s in finished] == ["A", "B"]
    assert all(
        s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 3 for s in finished
    )
    assert alloc.stats().num_used_blocks == 0


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = Scheduler(PagedAllocator(33, 4), max_num_batched_tokens=8, chunked_prefill=False)
    sched.add_request("A", range(1, 7), max_new_tokens=2)  # 6 tokens
    sched.add_request("B", range(11, 15), max_new_tokens=2)  # 4 tokens: 6 + 4 > 8
    b1, _ = step(sched)
    assert rows(b1) == [("A", 0, 6, 1, 0)]
    b2, _ = step(sched)
    assert rows(b2) == [("A", 6, 1, 1, 0), ("B", 0, 4, 1, 0)]


def test_max_num_seqs_caps_admission() -> None:
    sched = Scheduler(PagedAllocator(33, 4), max_num_seqs=2)
    for r in "ABC":
        sched.add_request(r, [ord(r)] * 3, max_new_tokens=2)
    b1, _ = step(sched)
    assert [s.seq.request_id for s in b1.seqs] == ["A", "B"] and sched.num_waiting == 1


def _three_seqs_full_pool(policy):
    """3 usable blocks of 4; A (4 tokens), B (2), C (3) fill one block each. After one step
    A needs a second block for its 5th token; B and C still fit in theirs."""
    alloc = PagedAllocator(4, 4)
    sched = Scheduler(alloc, victim_policy=policy)
    sched.add_request("A", [1, 2, 3, 4], max_new_tokens=4, arrival_time_s=0.0)
    sched.add_request("B", [5, 6], max_new_tokens=4, arrival_time_s=1.0)
    sched.add_request("C", [7, 8, 9], max_new_tokens=4, arrival_time_s=2.0)
    b1, _ = step(sched)
    assert rows(b1) == [("A", 0, 4, 1, 0), ("B", 0, 2, 1, 0), ("C", 0, 3, 1, 0)]
    assert alloc.num_allocatable_blocks == 0
    return sched


def test_preemption_default_victim_is_the_latest_arrival() -> None:
    sched = _three_seqs_full_pool(Scheduler.__init__.__kwdefaults__["victim_policy"])
    b2, _ = step(sched)
    assert rows(b2) == [("A", 4, 1, 1, 0), ("B", 2, 1, 1, 0)]
    assert [s.request_id for s in b2.preempted] == ["C"]
    (c,) = b2.preempted
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.waiting[0] is c
    assert c.num_output_tokens == 1  # keeps its sampled token; it is recomputed, not resampled


def test_preemption_least_computed_victim() -> None:
    sched = _three_seqs_full_pool(least_computed)
    b2, _ = step(sched)
    assert rows(b2) == [("A", 4, 1, 1, 0), ("C", 3, 1, 1, 0)]
    assert [s.request_id for s in b2.preempted] == ["B"]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = _three_seqs_full_pool(Scheduler.__init__.__kwdefaults__["victim_policy"])
    sched.add_request("D", [42], max_new_tokens=1)  # would fit in C's freed block
    b2, _ = step(sched)
    assert [s.seq.request_id for s in b2.seqs] == ["A", "B"]
    assert [s.request_id for s in sched.waiting] == ["C", "D"]  # preempted at the head


def test_preempted_sequences_finish_like_unpreempted_ones() -> None:
    prompts = {f"r{i}": [i * 10 + j for j in range(3 + 2 * i)] for i in range(6)}

    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = Scheduler(PagedAllocator(num_blocks, 4), max_num_batched_tokens=16)
        for rid, prompt in prompts.items():
            sched.add_request(rid, prompt, max_new_tokens=9)
        done = run_to_completion(sched)
        stats = sched.allocator.stats()
        assert stats.num_used_blocks == 0 and stats.num_seqs == 0  # no leak
        assert all(s.finish_reason is FinishReason.LENGTH for s in done)
        return {s.request_id: s.output_token_ids for s in done}, sched.num_preemptions

    roomy, roomy_preemptions = outputs(200)
    tight, tight_preemptions = outputs(9)  # 8 blocks = 32 slots for six 12..22-token requests
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy
    assert all(len(v) == 9 for v in tight.values())


def test_recomputed_tokens_are_counted_once_per_redo() -> None:
    sched = _three_seqs_full_pool(Scheduler.__init__.__kwdefaults__["victim_policy"])
    run_to_completion(sched)
    # C had computed 3 tokens when preempted; its block was partial (not cached), so all 3 are
    # computed again, plus any later preemptions of the same kind.
    assert sched.num_preemptions >= 1
    assert sched.num_recomputed_tokens >= 3


def test_requests_that_can_never_fit_are_refused_at_once() -> None:
    sched = Scheduler(PagedAllocator(5, 4), max_model_len=16)  # 4 blocks = 16 slots
    too_long = sched.add_request("ctx", range(10), max_new_tokens=7)
    assert too_long.finish_reason is FinishReason.REFUSED and too_long.is_finished
    assert "exceeds the context of 16 tokens" in too_long.finish_detail
    ok = sched.add_request("ok", range(10), max_new_tokens=6)
    b1, _ = step(sched)
    assert b1.refused == (too_long,) and [s.seq for s in b1.seqs] == [ok]
    assert sched.num_refused == 1 and too_long not in sched.waiting

    big = Scheduler(PagedAllocator(5, 4)).add_request("pool", range(10), max_new_tokens=8)
    assert big.finish_reason is FinishReason.REFUSED
    assert "need 5 KV blocks of 4 tokens at once; the whole KV pool has 4" in big.finish_detail

    strict = Scheduler(PagedAllocator(50, 4), max_num_batched_tokens=8, chunked_prefill=False)
    assert strict.add_request("chunk", range(9), 1).finish_reason is FinishReason.REFUSED


def test_stop_token_finishes_and_frees() -> None:
    alloc = PagedAllocator(9, 4)
    sched = Scheduler(alloc)
    seq = sched.add_request("s", [1, 2, 3], max_new_tokens=10, stop_token_ids=[99])
    batch = sched.schedule()
    assert sched.update(batch, [[5]]).finished == []
    batch = sched.schedule()
    assert sched.update(batch, [[99]]).finished == [seq]
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == [5, 99]
    assert alloc.stats().num_used_blocks == 0 and not sched.has_unfinished()


def test_update_rejects_mismatched_token_lists() -> None:
    sched = Scheduler(PagedAllocator(9, 4))
    sched.add_request("s", [1, 2, 3], max_new_tokens=2)
    batch = sched.schedule()
    with pytest.raises(ValueError, match="1 sampled tokens"):
        sched.update(batch, [[]])
    with pytest.raises(ValueError, match="token lists"):
        sched.update(batch, [])


def test_prefix_hit_is_reported_at_admission() -> None:
    alloc = PagedAllocator(33, 4)
    sched = Scheduler(alloc)
    sched.add_request("A", range(10), max_new_tokens=2)
    step(sched)
    sched.add_request("B", [*range(9), 77], max_new_tokens=2)  # shares 9 tokens = 2 blocks
    b2, _ = step(sched)
    assert rows(b2)[1] == ("B", 8, 2, 1, 8) and b2.prefix_hit_tokens == 8


def test_abort_frees_blocks_at_once() -> None:
    alloc = PagedAllocator(17, 4)
    sched = Scheduler(alloc)
    sched.add_request("A", range(10), max_new_tokens=5)
    sched.add_request("W", range(100, 103), max_new_tokens=5, n=2)
    batch = sched.schedule()
    assert alloc.num_allocatable_blocks < 16
    aborted = sched.abort("A") + sched.abort("W")
    assert all(s.finish_reason is FinishReason.ABORT for s in aborted) and len(aborted) == 2
    assert alloc.stats().num_used_blocks == 0 and not sched.has_unfinished()
    alloc.check_invariants()
    assert sched.update(batch, [[1], [2, 3]]).finished == []  # a step in flight is ignored
    assert sched.abort("A") == []


def test_config_validates_and_builds() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="preemption policy"):
        SchedulerConfig(preemption="random")
    sched = SchedulerConfig(max_num_seqs=3, preemption="least_computed").build(PagedAllocator(9, 4))
    assert sched.max_num_seqs == 3 and sched.victim_policy is least_computed


class CountingPaged(PagedAllocator):
    """A paged allocator that counts prefix lookups."""

    num_matches = 0

    def match_prefix(self, seq):
        self.num_matches += 1
        return super().match_prefix(seq)


def test_a_refused_head_is_retried_only_after_blocks_free_up() -> None:
    alloc = CountingPaged(5, 4)  # 4 usable blocks
    sched = Scheduler(alloc)
    sched.add_request("A", range(1, 13), max_new_tokens=3)  # 12 tokens: 3 blocks, then a 4th
    sched.add_request("B", range(50, 56), max_new_tokens=1)  # 6 tokens: needs 2 blocks
    b1, _ = step(sched)  # A admitted; B refused by the allocator (1 block free)
    assert [s.seq.request_id for s in b1.seqs] == ["A"] and alloc.num_matches == 2
    b2, _ = step(sched)  # A takes the last block: B is not even looked up
    assert [s.seq.request_id for s in b2.seqs] == ["A"] and alloc.num_matches == 2
    _, finished = step(sched)  # A finishes and frees its 4 blocks
    assert [s.request_id for s in finished] == ["A"]
    b4, _ = step(sched)
    assert [s.seq.request_id for s in b4.seqs] == ["B"] and alloc.num_matches == 3


def test_sequence_is_seqlike_and_a_cache_salt_isolates_prefixes() -> None:
    from pagedkv.kvcache import HashExtraKeys
    from pagedkv.kvcache.protocol import SeqLike

    alloc = PagedAllocator(33, 4)
    sched = Scheduler(alloc)
    a = sched.add_request("A", range(10), max_new_tokens=2)
    assert isinstance(a, SeqLike) and a.cache_salt is None
    step(sched)
    salted = sched.add_request(
        "S", range(10), max_new_tokens=2, extra_keys=HashExtraKeys(cache_salt="user-7")
    )
    plain = sched.add_request("P", range(10), max_new_tokens=2)
    b2, _ = step(sched)
    assert salted.cache_salt == "user-7"
    assert [(s.seq.request_id, s.prefix_hit_tokens) for s in b2.seqs[1:]] == [("S", 0), ("P", 8)]
    assert plain.prompt_token_ids.tolist() == list(range(10)) and not plain.is_prefilling


def test_finish_sequence_frees_one_sequence_and_keeps_its_siblings() -> None:
    alloc = PagedAllocator(20, 4)
    sched = Scheduler(alloc)
    parent = sched.add_request("r", range(1, 7), max_new_tokens=5, n=2)
    other = sched.add_request("o", range(30, 33), max_new_tokens=5)
    b1 = sched.schedule()
    sched.update(b1, [[10, 11], [12]])
    child = sched.running[-1]
    assert child.parent is parent
    assert sched.finish_sequence(parent) and parent.finish_reason is FinishReason.STOP
    assert not sched.finish_sequence(parent)  # already finished
    alloc.check_invariants()
    assert parent not in sched.running and child in sched.running
    assert sched.finish_sequence(other, FinishReason.ABORT) and sched.num_running == 1
    queued = sched.add_request("q", [5], max_new_tokens=1)
    assert sched.finish_sequence(queued) and sched.num_waiting == 0
    done = run_to_completion(sched)
    assert done == [child] and child.num_output_tokens == 5
    assert alloc.stats().num_used_blocks == 0 and not sched.abort("r")


def _drive(sched: Scheduler, max_steps: int = 200) -> bool:
    """Run with a fake model that always samples token 1; True when everything finished."""
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return True
        batch = sched.schedule()
        sched.update(batch, [[1] * item.num_samples for item in batch.seqs])
        sched.allocator.check_invariants()
    return False


def test_without_chunked_prefill_a_recompute_longer_than_the_budget_still_runs():
    # b is preempted after growing to 13 tokens, more than one step's 8-token budget.
    sched = Scheduler(
        PagedAllocator(7, 4, prefix_caching=False),
        max_num_batched_tokens=8,
        max_model_len=64,
        chunked_prefill=False,
    )
    sched.add_request("a", list(range(4)), 16)
    sched.add_request("b", list(range(100, 104)), 16)
    assert _drive(sched)
    assert sched.num_preemptions > 0
    assert sched.allocator.stats().num_used_blocks == 0
    # A child of an n > 1 request that could not fork recomputes prompt + 1 > the budget.
    sched = Scheduler(
        PagedAllocator(20, 4, prefix_caching=False),
        max_num_seqs=1,
        max_num_batched_tokens=8,
        max_model_len=64,
        chunked_prefill=False,
    )
    sched.add_request("c", list(range(8)), 3, n=2)
    assert _drive(sched)
