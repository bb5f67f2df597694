"""``EngineLoop`` without HTTP: the contract its handlers rely on (one final item per request,
nothing after an abort, shutdown fails what is left) on a tiny random model."""

from __future__ import annotations

import threading

import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.server.engine_loop import EngineLoop, Failure, Submission

from .conftest import wait_for

LONG = SamplingParams(max_tokens=100, ignore_eos=True)


class Inbox:
    """A thread-safe ``deliver`` that records what arrives."""

    def __init__(self) -> None:
        self.items: list = []
        self._lock = threading.Lock()

    def __call__(self, item) -> None:
        with self._lock:
            self.items.append(item)

    @property
    def final(self):
        last = self.items[-1] if self.items else None
        return last if isinstance(last, Failure) or (last and last.finished) else None


@pytest.fixture
def loop(tiny_loaded):
    config = EngineConfig(log_startup=False, block_size=4, max_model_len=128)
    engine_loop = EngineLoop(LLMEngine(config, parts=build_parts(config, tiny_loaded)))
    engine_loop.start()
    yield engine_loop
    engine_loop.stop()


def test_every_request_ends_with_exactly_one_final_item(loop):
    inboxes = [Inbox() for _ in range(5)]
    for i, inbox in enumerate(inboxes):
        loop.submit(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=6, ignore_eos=True), None,
                    inbox)  # fmt: skip
    wait_for(lambda: all(b.final for b in inboxes), 30, "every request to finish")
    for inbox in inboxes:
        assert sum(1 for o in inbox.items if o.finished) == 1
        assert len(inbox.final.outputs[0].token_ids) == 6
    wait_for(lambda: loop.snapshot.engine.num_used_blocks == 0, 5, "the blocks to be freed")
    assert loop.snapshot.engine.peak_running_seqs >= 2  # they shared steps


def test_engine_refusal_is_a_400_failure(loop):
    inbox = Inbox()
    loop.submit("bad", [1] * 100, SamplingParams(max_tokens=100), None, inbox)  # > context
    wait_for(lambda: inbox.final is not None, 10, "the refusal")
    (failure,) = inbox.items
    assert failure.status_code == 400 and "exceeds the context" in failure.message


class HeldInbox(Inbox):
    """An ``Inbox`` that holds the engine thread on the first output until ``release``: the
    request is then still in flight when the test's next command is queued, however busy the
    machine is (outputs are delivered on the engine thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.released = threading.Event(), threading.Event()

    def __call__(self, item) -> None:
        super().__call__(item)
        if not self.first.is_set():
            self.first.set()
            self.released.wait(10)

    def release_after_queued(self, loop) -> None:
        wait_for(lambda: loop._commands.qsize() > 0, 10, "the command to be queued")
        self.released.set()


def test_abort_frees_blocks_and_nothing_follows(loop):
    inbox = HeldInbox()
    loop.submit("long", [1, 2, 3], LONG, None, inbox)
    assert inbox.first.wait(10), "no first output"
    loop.abort("long")
    inbox.release_after_queued(loop)
    wait_for(lambda: loop.snapshot.num_requests_in_flight == 0, 10, "the abort")
    seen = len(inbox.items)
    wait_for(lambda: loop.snapshot.engine.num_used_blocks == 0, 5, "the blocks to be freed")
    assert inbox.final is None and len(inbox.items) == seen


def test_stop_fails_requests_in_flight_and_later_submits(loop):
    inbox, late = HeldInbox(), Inbox()
    loop.submit("long", [1, 2, 3], LONG, None, inbox)
    assert inbox.first.wait(10), "no first output"
    stopper = threading.Thread(target=loop.stop)  # stop() queues its command, then joins
    stopper.start()
    inbox.release_after_queued(loop)
    stopper.join(15)
    assert not loop.alive
    assert isinstance(inbox.final, Failure) and inbox.final.status_code == 503
    loop.submit("late", [1], LONG, None, late)
    assert isinstance(late.final, Failure) and late.final.code == "shutting_down"
    loop.engine.allocator.check_invariants()
    assert loop.engine.allocator.stats().num_used_blocks == 0


def test_queued_requests_are_admitted_in_turn_and_aborts_skip_them(tiny_loaded):
    """With one sequence admitted ahead, a group's prompts reach the engine one at a time, in
    turn with a later group's; an abort while queued means the prompt never runs."""
    config = EngineConfig(log_startup=False, block_size=4, max_model_len=128, max_num_seqs=1)
    engine_loop = EngineLoop(LLMEngine(config, parts=build_parts(config, tiny_loaded)),
                             admit_ahead_seqs=1)  # fmt: skip
    order: list[str] = []

    def inbox_for(request_id: str) -> Inbox:
        inbox = Inbox()

        def deliver(item) -> None:
            if not isinstance(item, Failure) and item.finished:
                order.append(request_id)
            inbox(item)

        inbox.deliver = deliver
        return inbox

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    big = {f"big-{i}": inbox_for(f"big-{i}") for i in range(4)}
    small = inbox_for("small")
    engine_loop.submit_group(
        [Submission(r, [1, 2, 3], params, None, b.deliver) for r, b in big.items()]
    )
    engine_loop.abort("big-3")  # still queued: it never reaches the engine
    engine_loop.submit("small", [4, 5], params, None, small.deliver)
    engine_loop.start()
    try:
        wait_for(lambda: len(order) == 4, 30, "the four live requests to finish")
        assert order.index("small") <= 2  # not after every prompt of the first group
        assert not big["big-3"].items
        wait_for(lambda: engine_loop.snapshot.num_requests_in_flight == 0, 5, "nothing in flight")
        assert engine_loop.snapshot.num_requests_queued == 0
    finally:
        engine_loop.stop()


def test_the_server_reads_one_face_of_the_engine():
    """No server module reaches into the engine's parts (issue 10, item 5): it reads ``info``,
    ``snapshot()``, ``check_request`` and ``tokenizer``, and drives add/step/abort."""
    import ast
    from pathlib import Path

    import pagedkv.server

    inner = {"allocator", "recorder", "scheduler", "parts", "runner"}
    found = []
    for path in Path(pagedkv.server.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in inner:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not found, found


def test_an_engine_bug_adding_one_request_fails_only_that_request(loop):
    real_add = loop.engine.add_request

    def add_request(prompt, params, request_id=None, cache_salt=None):
        if request_id == "bad":
            raise RuntimeError("injected add failure")
        return real_add(prompt, params, request_id=request_id, cache_salt=cache_salt)

    loop.engine.add_request = add_request
    bad, good = Inbox(), Inbox()
    loop.submit("bad", [1, 2], SamplingParams(max_tokens=2), None, bad)
    loop.submit("good", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), None, good)
    wait_for(lambda: bad.final and good.final, 10, "both requests to end")
    assert isinstance(bad.final, Failure) and bad.final.status_code == 500
    assert not isinstance(good.final, Failure) and loop.alive
