"""``EngineLoop.call``: a function of the engine run on the engine thread between steps (what
an engine replica on Ray Serve reads its prefix cache's hashes with), refused once stopped."""

from __future__ import annotations

import threading

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.routing import prompt_block_hashes
from pagedkv.serve_ray.engine_replica import held_block_hashes
from pagedkv.server.engine_call import EngineCall
from pagedkv.server.engine_loop import EngineLoop

from .conftest import wait_for
from .test_engine_loop import Inbox


@pytest.fixture
def loop(tiny_loaded):
    config = EngineConfig(log_startup=False, block_size=4, max_model_len=128)
    engine_loop = EngineLoop(LLMEngine(config, parts=build_parts(config, tiny_loaded)))
    engine_loop.start()
    yield engine_loop
    engine_loop.stop()


def test_a_call_runs_on_the_engine_thread_and_returns_its_result(loop):
    call = EngineCall(lambda engine: (threading.current_thread().name, engine is loop.engine))
    loop.call(call)
    assert call.future.result(timeout=10) == ("pagedkv-engine", True)


def test_a_call_that_raises_fails_its_future_not_the_loop(loop):
    call = EngineCall(lambda engine: 1 / 0)
    loop.call(call)
    with pytest.raises(ZeroDivisionError):
        call.future.result(timeout=10)
    assert loop.alive


def test_the_held_hashes_are_what_a_router_hashes_of_the_prompt(loop):
    """After a request of 13 tokens (3 full blocks of 4 before its last token) and 2 more
    finishes, the replica reports exactly the hashes ``pagedkv.routing`` computes for that
    prompt: what a router matches a later request against."""
    prompt = list(range(1, 14))
    inbox = Inbox()
    loop.submit("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True), None, inbox)
    wait_for(lambda: inbox.final is not None, 30, "the request to finish")
    call = EngineCall(held_block_hashes)
    loop.call(call)
    assert sorted(call.future.result(timeout=10)) == sorted(prompt_block_hashes(prompt, 4))


def test_a_call_after_stop_is_refused(loop):
    loop.stop()
    call = EngineCall(lambda engine: 1)
    loop.call(call)
    with pytest.raises(RuntimeError, match="stopped"):
        call.future.result(timeout=1)
