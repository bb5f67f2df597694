"""Fair admission between HTTP requests (issue 9, item 3): the prompts of one request are
handed to the engine a few at a time, taking turns with other requests, so a small request
sent after a giant one finishes long before the giant one does. Also the cap on prompts x n."""

from __future__ import annotations

import json
import threading
import time

import httpx

from pagedkv.server.fair_queue import FairQueue

from .conftest import assert_idle, running_server, wait_for
from .test_api import POOL

NUM_BIG_PROMPTS = 96
# At most 8 sequences run at once, each 3 prompt tokens + 25 = 28 tokens = 7 blocks of 4: all
# 8 fit the 63 usable blocks (no preemption), and the big request needs 12 waves of decoding.
ENGINE = {**POOL, "max_num_seqs": 8}
BIG = {
    "prompt": [[1, 2, 3 + i % 50] for i in range(NUM_BIG_PROMPTS)],
    "max_tokens": 25,
    "ignore_eos": True,
    "stream": True,
}
SMALL = {"prompt": [7, 8, 9], "max_tokens": 2, "ignore_eos": True}


def test_a_small_request_does_not_wait_behind_a_giant_one(tiny_loaded):
    with running_server(tiny_loaded, **ENGINE) as (url, _):
        finished_big = [0]
        started = threading.Event()

        def stream_big() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=BIG, timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        finished_big[0] += sum(1 for c in choices if c["finish_reason"])

        big = threading.Thread(target=stream_big)
        big.start()
        wait_for(started.is_set, 30, "the big request to start streaming")
        t0 = time.monotonic()
        small = httpx.post(f"{url}/v1/completions", json=SMALL, timeout=120)
        small_s, done_when_small_finished = time.monotonic() - t0, finished_big[0]
        big.join(120)
        assert small.status_code == 200, small.text
        assert finished_big[0] == NUM_BIG_PROMPTS
        # First come, first served would run the small request after ~88 of the 96 prompts.
        assert done_when_small_finished < NUM_BIG_PROMPTS // 2, (
            f"the small request finished after {done_when_small_finished} of the big "
            f"request's {NUM_BIG_PROMPTS} prompts ({small_s:.2f} s)"
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
