"""Fair admission between HTTP requests (issue 9, item 3): the prompts of one request are
handed to the engine a few at a time, taking turns with other requests, so a small request
sent after a giant one finishes long before the giant one does. Also the cap on prompts x n.

The HTTP test holds the engine thread after the giant request's first step until the small
request is queued, and counts finishes in the order the engine reported them: how many of the
giant's prompts finish first is then the same on a quiet machine and a busy one."""

from __future__ import annotations

import json
import threading

import httpx

from pagedkv.server.fair_queue import FairQueue

from .conftest import assert_idle, running_server, wait_for
from .test_api import POOL

NUM_BIG_PROMPTS = 96
MAX_NUM_SEQS = 8
# At most 8 sequences run at once, each 3 prompt tokens + 25 = 28 tokens = 7 blocks of 4: all
# 8 fit the 63 usable blocks (no preemption), and the big request needs 12 waves of decoding.
ENGINE = {**POOL, "max_num_seqs": MAX_NUM_SEQS}
BIG = {
    "prompt": [[1, 2, 3 + i % 50] for i in range(NUM_BIG_PROMPTS)],
    "max_tokens": 25,
    "ignore_eos": True,
    "stream": True,
}
SMALL = {"prompt": [7, 8, 9], "max_tokens": 2, "ignore_eos": True}
HOLD_S = 60  # the longest the engine thread waits for the small request to be queued


class AdmissionGate:
    """Wraps a server's engine loop: notes which HTTP request's group was submitted, holds the
    engine thread before its second step until a one-prompt group (the small request) has been
    queued, and records the engine's finished request ids in the order the steps returned them
    (written on the engine thread, read after the requests end)."""

    def __init__(self, engine_loop) -> None:
        self.holding = threading.Event()  # the engine thread waits for the small request
        self.small_queued = threading.Event()
        self.small_id: str | None = None
        self.timed_out = False
        self.finished_ids: list[str] = []
        self._num_steps = 0
        submit_group, step = engine_loop.submit_group, engine_loop.engine.step

        def gated_submit_group(group) -> None:  # on the event loop's thread
            submit_group(group)  # the command is queued when this returns
            if len(group) == 1:
                self.small_id = group[0].request_id
                self.small_queued.set()

        def gated_step():  # on the engine thread
            if self._num_steps == 1:  # the giant's first step is done: now the small arrives
                self.holding.set()
                self.timed_out = not self.small_queued.wait(HOLD_S)
            outputs = step()
            self._num_steps += 1
            self.finished_ids += [out.request_id for out in outputs if out.finished]
            return outputs

        engine_loop.submit_group = gated_submit_group
        engine_loop.engine.step = gated_step


def test_a_small_request_does_not_wait_behind_a_giant_one(tiny_loaded):
    with running_server(tiny_loaded, **ENGINE) as (url, app):
        gate = AdmissionGate(app.state.engine_loop)
        finished_big = [0]

        def stream_big() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=BIG, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        finished_big[0] += sum(1 for c in choices if c["finish_reason"])

        big = threading.Thread(target=stream_big)
        big.start()
        wait_for(gate.holding.is_set, 30, "the big request's first step")
        small = httpx.post(f"{url}/v1/completions", json=SMALL, timeout=120)
        big.join(120)
        assert not gate.timed_out, "the small request never reached the engine loop"
        assert small.status_code == 200, small.text
        assert finished_big[0] == NUM_BIG_PROMPTS
        order = gate.finished_ids
        assert len(order) == NUM_BIG_PROMPTS + 1 and gate.small_id in order
        big_before_small = order.index(gate.small_id)
        # Fair: behind the running batch and the few prompts queued ahead in the engine
        # (8 running + the loop's ADMIT_AHEAD_SEQS of 16: 24). First come, first served: 96.
        assert big_before_small < NUM_BIG_PROMPTS // 2, (
            f"the small request finished after {big_before_small} of the big request's "
            f"{NUM_BIG_PROMPTS} prompts"
        )
        assert_idle(url)


def test_the_cap_on_prompts_times_n_names_itself(tiny_loaded):
    with running_server(tiny_loaded, max_samples_per_request=6, **POOL) as (url, _):
        body = {"prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 1}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "too_many_samples" and error["param"] == "prompt"
        assert "at most 6" in error["message"] and "--max-samples-per-request" in error["message"]
        body["prompt"] = ["a", "b", "c"]  # 3 x 2 = 6: at the cap, served
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200


class _Item:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_fair_queue_takes_turns_and_skips_removed_items():
    q: FairQueue[_Item] = FairQueue()
    q.add_group(_Item(f"big-{i}") for i in range(4))
    q.add_group([_Item("small-0"), _Item("small-1")])
    assert q.pop().request_id == "big-0"
    q.add_group([_Item("late-0")])
    assert q.remove("big-1") and not q.remove("big-1") and len(q) == 5
    order = [q.pop().request_id for _ in range(5)]
    assert order == ["small-0", "big-2", "late-0", "small-1", "big-3"]
    assert q.pop() is None and len(q) == 0
    q.add_group([_Item("x")])
    assert [i.request_id for i in q.drain()] == ["x"] and q.pop() is None
