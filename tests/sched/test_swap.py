"""Swap preemption: victims' blocks go to the host swap space and come back, progress kept."""

from __future__ import annotations

import pytest

from pagedkv.kvcache import PagedAllocator, build_allocator
from pagedkv.sched import FinishReason, Scheduler, SchedulerConfig, SequenceStatus
from tests.sched.helpers import run_to_completion, sample
from tests.sched.kv_memory import KVMemory

SWAP = SchedulerConfig(preemption_mode="swap", swap_space_slots=64)


def drive(sched: Scheduler, max_steps: int = 5000):
    """Run to completion through the KV memory model; every finished sequence, in order."""
    memory, done = KVMemory(sched), []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return done
        batch = sched.schedule()
        sched.check_invariants()
        assert batch.seqs, "a step with work left scheduled nothing"
        memory.run(batch)
        done.extend(sched.update(batch, sample(batch)).finished)
        sched.check_invariants()
    raise AssertionError("not finished")


def _three_seqs_full_pool(swap_space_slots: int = 64) -> Scheduler:
    """3 usable blocks of 4; A (4 tokens), B (2), C (3) fill one block each. After one step
    A needs a second block for its 5th token: C (latest arrival) gives way."""
    config = SchedulerConfig(preemption_mode="swap", swap_space_slots=swap_space_slots)
    sched = config.build(PagedAllocator(4, 4))
    sched.add_request("A", [1, 2, 3, 4], max_new_tokens=4, arrival_time_s=0.0)
    sched.add_request("B", [5, 6], max_new_tokens=4, arrival_time_s=1.0)
    sched.add_request("C", [7, 8, 9], max_new_tokens=4, arrival_time_s=2.0)
    batch = sched.schedule()
    sched.update(batch, sample(batch))
    return sched


def test_a_victim_is_swapped_out_with_its_progress_and_back_in_before_admissions() -> None:
    sched = _three_seqs_full_pool()
    c = sched.running[2]
    c_block = sched.allocator.block_table(c)[0]
    sched.add_request("D", [42], max_new_tokens=1)
    b2 = sched.schedule()
    # The swap-out orders exactly C's one block to host block 0; C keeps its 3 computed tokens.
    assert b2.swap_out == ((c_block, 0),) and b2.swap_in == ()
    assert b2.preempted == (c,) and c.status is SequenceStatus.SWAPPED
    assert c.num_computed_tokens == 3 and list(sched.swapped) == [c]
    assert [s.seq.request_id for s in b2.seqs] == ["A", "B"]
    assert (sched.num_swap_outs, sched.num_swapped_blocks_out, sched.num_preemptions) == (1, 1, 1)
    sched.check_invariants()
    sched.update(b2, sample(b2))
    # Later, when blocks free up, C comes back before D is admitted, and resumes at token 3.
    while c.status is SequenceStatus.SWAPPED:
        batch = sched.schedule()
        assert "D" not in [s.seq.request_id for s in batch.seqs]
        sched.check_invariants()
        sched.update(batch, sample(batch))
    (item,) = [s for s in batch.seqs if s.seq is c]
    assert (item.num_computed_tokens, item.num_new_tokens, item.prefix_hit_tokens) == (3, 1, 0)
    assert (0, sched.allocator.block_table(c)[0]) in batch.swap_in  # host block 0 comes back
    run_to_completion(sched)  # (B is swapped out and in on the way)
    assert sched.num_swap_ins == sched.num_swap_outs >= 1
    assert sched.num_swapped_blocks_in <= sched.num_swapped_blocks_out  # cached ones stay
    assert sched.num_recomputed_tokens == 0 and sched.swap_space.num_used_blocks == 0


def test_a_full_swap_space_falls_back_to_recompute() -> None:
    sched = _three_seqs_full_pool(swap_space_slots=4)
    sched.swap_space.take(999, 1)  # the only host block is taken
    b2 = sched.schedule()
    (c,) = b2.preempted
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert b2.swap_out == () and sched.num_swap_fallbacks == 1 and sched.num_swap_outs == 0
    assert sched.num_preemptions == 1 and sched.swap_space.num_free_blocks == 0


FACTORIES = {
    "vllm": lambda slots: build_allocator("vllm", slots, 512),
    "paged:4": lambda slots: build_allocator("paged:4", slots, 512),
    "paged-nocache:8": lambda slots: build_allocator("paged-nocache:8", slots, 512),
    "sglang": lambda slots: build_allocator("sglang", slots, 512),
    "radix:4": lambda slots: build_allocator("radix:4", slots, 512),
    "reserved": lambda slots: build_allocator("reserved", slots, 64),
}


def _outputs(kind: str, num_slots: int, config: SchedulerConfig, n: int = 1):
    sched = config.build(FACTORIES[kind](num_slots))
    stem = list(range(300, 318))  # shared by half the requests: prefix hits happen
    for i in range(8):
        prompt = (stem if i % 2 else []) + [i * 50 + j for j in range(3 + 3 * i)]
        sched.add_request(f"r{i}", prompt, max_new_tokens=12, n=n if i == 3 else 1)
    done = drive(sched)
    stats = sched.allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_seqs == 0
    assert all(s.finish_reason is FinishReason.LENGTH for s in done)
    outs = sorted((s.request_id, s.output_token_ids) for s in done)
    return outs, sched


@pytest.mark.parametrize("kind", list(FACTORIES))
@pytest.mark.parametrize("n", [1, 2])
def test_swapped_sequences_finish_like_unpreempted_ones(kind: str, n: int) -> None:
    tight_slots = 256 if kind == "reserved" else 96
    roomy, roomy_sched = _outputs(kind, 100_000, SchedulerConfig(max_num_batched_tokens=24), n)
    config = SchedulerConfig(
        max_num_batched_tokens=24, preemption_mode="swap", swap_space_slots=100_000
    )
    tight, sched = _outputs(kind, tight_slots, config, n)
    assert roomy_sched.num_preemptions == 0
    if kind == "reserved":  # a region holds max_model_len from admission: nothing to preempt
        assert sched.num_preemptions == 0 and tight == roomy
        return
    assert sched.num_swap_outs > 0 and sched.num_swap_fallbacks == 0
    assert sched.num_swap_ins == sched.num_swap_outs
    # Everything came back from the host: nothing stayed swapped, and nothing was recomputed
    # (with n = 2 a child forked when no block is free for its tail still recomputes).
    assert sched.swap_space.num_used_blocks == 0
    assert sched.num_recomputed_tokens == 0 or n > 1
    assert sched.num_swapped_blocks_in <= sched.num_swapped_blocks_out
    assert tight == roomy


def test_a_small_swap_space_mixes_swap_and_recompute_and_still_finishes() -> None:
    config = SchedulerConfig(max_num_batched_tokens=24, preemption_mode="swap", swap_space_slots=24)
    roomy, _ = _outputs("paged:4", 100_000, SchedulerConfig(max_num_batched_tokens=24))
    tight, sched = _outputs("paged:4", 96, config)
    assert sched.num_swap_outs > 0 and sched.num_swap_fallbacks > 0
    assert sched.num_preemptions == sched.num_swap_outs + sched.num_swap_fallbacks
    assert tight == roomy


def test_abort_of_a_swapped_request_gives_its_host_blocks_back() -> None:
    sched = _three_seqs_full_pool()
    b2 = sched.schedule()
    (c,) = b2.preempted
    assert sched.swap_space.num_used_blocks == 1
    assert sched.abort("C") == [c]
    assert c.finish_reason is FinishReason.ABORT and not sched.swapped
    assert sched.swap_space.num_used_blocks == 0
    sched.check_invariants()


def test_config_validates_the_preemption_mode_and_swap_space() -> None:
    with pytest.raises(ValueError, match="preemption_mode 'swop'"):
        SchedulerConfig(preemption_mode="swop")
    with pytest.raises(ValueError, match="needs swap_space_slots > 0"):
        SchedulerConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="only used with preemption_mode='swap'"):
        SchedulerConfig(swap_space_slots=64)
    with pytest.raises(ValueError, match="swap_space_slots must be an integer >= 0"):
        SchedulerConfig(preemption_mode="swap", swap_space_slots=-1)
    with pytest.raises(ValueError, match="no whole KV block of 16 tokens"):
        SchedulerConfig(preemption_mode="swap", swap_space_slots=15).build(PagedAllocator(8, 16))
    sched = SWAP.build(PagedAllocator(8, 16))
    assert sched.swap_space.num_blocks == 4
    assert SchedulerConfig().build(PagedAllocator(8, 16)).swap_space is None
