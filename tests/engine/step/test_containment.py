"""One request must never stop the engine for the others: a failure inside a step (forward
pass or sampler) ends only the requests it can be traced to; their blocks come back; the engine
steps on. Faults are injected into a request that passed every validation."""

from __future__ import annotations

import pytest

import pagedkv.engine.step.draws as sampler_module
from pagedkv.engine import SamplingParams

from ..conftest import assert_no_leaks

PROMPTS = ["The capital of France is", "Count to ten: one, two,", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
POISON = SamplingParams(max_tokens=8, ignore_eos=True, seed=666)  # greedy, but recognisable


def _clean_tokens(make_engine) -> list[list[int]]:
    outs = make_engine().generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _run(engine, params) -> dict[str, object]:
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    final = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.allocator.check_invariants()  # after every step, failures included
        if not engine.has_unfinished():
            break
    return {i: final[i] for i in ids}


def test_a_sampler_failure_fails_only_its_request(make_engine, monkeypatch):
    clean = _clean_tokens(make_engine)
    real_sample = sampler_module.draw

    def sample(logits, params, generators, tokens=None, matchers=None):
        if any(p is POISON for p in params):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, params, generators, tokens, matchers)

    monkeypatch.setattr(sampler_module, "draw", sample)
    engine = make_engine()
    outs = list(_run(engine, [GREEDY, POISON, GREEDY]).values())
    assert outs[1].error and "probability tensor" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    # The others ran in the same batches and got exactly the tokens of a clean run.
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [clean[0], clean[2]]
    assert outs[0].error is None and outs[2].error is None
    assert engine.snapshot().num_failed_requests == 1
    assert_no_leaks(engine)
    # And the engine goes on serving.
    (after,) = engine.generate([PROMPTS[0]], GREEDY)
    assert after.outputs[0].token_ids == clean[0]


def test_a_forward_failure_is_traced_to_its_sequence(make_engine, monkeypatch):
    clean = _clean_tokens(make_engine)
    engine = make_engine()
    real_execute = engine.runner.execute

    def execute(batch, allocator, prev=None):
        if any(item.seq.request_id == "req-2" for item in batch.seqs):
            raise RuntimeError("simulated kernel fault")
        return real_execute(batch, allocator, prev)

    monkeypatch.setattr(engine.runner, "execute", execute)
    outs = list(_run(engine, [GREEDY, GREEDY, GREEDY]).values())
    assert [o.error is None for o in outs] == [True, True, False]
    assert "simulated kernel fault" in outs[2].error
    assert [o.outputs[0].token_ids for o in outs[:2]] == clean[:2]
    assert_no_leaks(engine)


def test_a_step_that_fails_for_everyone_fails_that_batch_and_the_engine_goes_on(
    make_engine, monkeypatch
):
    engine = make_engine()
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def execute(batch, allocator, prev=None):
        calls["n"] += 1
        if calls["n"] <= 4:  # the batch, then each of its three sequences alone
            raise MemoryError("out of memory")
        return real_execute(batch, allocator, prev)

    monkeypatch.setattr(engine.runner, "execute", execute)
    outs = list(_run(engine, [GREEDY, GREEDY, GREEDY]).values())
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert_no_leaks(engine)
    (after,) = engine.generate([PROMPTS[1]], GREEDY)
    assert after.error is None and len(after.outputs[0].token_ids) == 8


def test_a_device_fault_is_raised_not_retried_entry_by_entry(make_engine, monkeypatch):
    """A CUDA error (an illegal address) poisons the context: nothing can be blamed on one
    entry or retried, so the step raises it (the server then fails the engine's requests and,
    when it repeats, the engine) instead of failing every request forever, one by one."""
    engine = make_engine()
    calls = {"n": 0}

    def execute(batch, allocator, prev=None):
        calls["n"] += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "execute", execute)
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()
    assert calls["n"] == 1  # the batch once, no entry alone


def test_which_failures_are_device_faults():
    from pagedkv.engine.step.containment import device_fault

    class AcceleratorError(RuntimeError):  # torch's name for CUDA errors since 2.8
        pass

    assert device_fault(AcceleratorError("an illegal instruction was encountered"))
    assert device_fault(RuntimeError("CUDA error: misaligned address"))
    # out of memory is contained like any failure: smaller batches may fit
    assert not device_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not device_fault(MemoryError("out of memory"))
    assert not device_fault(RuntimeError("simulated kernel fault"))


def test_top_p_that_underflows_is_refused_before_it_can_reach_the_sampler():
    from pagedkv.errors import UsageError

    with pytest.raises(UsageError) as info:
        SamplingParams(temperature=1.0, top_p=1e-300)
    assert info.value.param == "top_p"
