"""The server streams exactly the engine's text (issue 10, item 3): the engine's detokenizer
owns the stop-string hold-back, so every streamed prefix is a text the engine itself exposed
after some step -- the server holds nothing back of its own (it used to hold back
``len(stop) - 1`` characters more).

How many steps share a chunk depends on how fast the client reads (a slow reader gets the
newest snapshot, a larger delta), so the test runs the engine in lockstep with the client:
before each step the engine thread waits until the client has read the text the previous
step exposed. Every exposed text then reaches the client as its own chunk, on a quiet machine
and on a busy one."""

from __future__ import annotations

import json
import threading

import httpx

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts

from .conftest import running_server
from .test_api import POOL

PROMPT_IDS = [5, 17, 42, 9]
STOP = "zqxj"  # 4 characters that the random model's text never contains
MAX_TOKENS = 24
READ_WAIT_S = 30  # the longest the engine waits for the client to read a text


def _engine_texts(loaded) -> list[str]:
    """Sample 0's text after every step of the engine on its own."""
    config = EngineConfig(log_startup=False, **POOL)
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=(STOP,), ignore_eos=True)
    return [out.outputs[0].text for _, out in engine.stream(PROMPT_IDS, params)]


def _distinct(texts: list[str]) -> list[str]:
    """The non-empty texts in order, each once (a step that adds no text repeats the last)."""
    return [t for i, t in enumerate(texts) if t and (i == 0 or t != texts[i - 1])]


class Lockstep:
    """Wraps a server's ``engine.step``: before each step, the engine thread waits until the
    client has ``read`` the text the previous step exposed (it is delivered between steps).
    After one wait in vain (a text the server never sends) it stops waiting and notes it."""

    def __init__(self, engine) -> None:
        self.missed: str | None = None  # the first exposed text the client never read
        self._read: set[str] = set()
        self._cond = threading.Condition()
        self._last = ""
        step = engine.step

        def lockstep_step():  # on the engine thread
            with self._cond:
                if self._last and self.missed is None:
                    seen = self._cond.wait_for(lambda: self._last in self._read, READ_WAIT_S)
                    self.missed = None if seen else self._last
            outputs = step()
            if outputs:
                self._last = outputs[0].outputs[0].text
            return outputs

        engine.step = lockstep_step

    def read(self, text: str) -> None:
        """The client has received everything up to ``text`` (on the client's thread)."""
        with self._cond:
            self._read.add(text)
            self._cond.notify_all()


def test_streamed_text_is_always_the_engines_exposed_text(tiny_loaded):
    exposed = _engine_texts(tiny_loaded)
    assert len(exposed[-1]) > 8  # enough text for a hold-back to show
    body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": STOP,
            "ignore_eos": True, "stream": True}  # fmt: skip
    sent, prefixes = "", []
    with running_server(tiny_loaded, **POOL) as (url, app):
        lockstep = Lockstep(app.state.engine_loop.engine)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    sent += json.loads(line[6:])["choices"][0]["text"]
                    prefixes.append(sent)
                    lockstep.read(sent)
    assert sent == exposed[-1]
    not_exposed = [p for p in prefixes if p not in exposed]
    assert not not_exposed, f"streamed text the engine never exposed: {not_exposed[:3]}"
    # Streamed as it is made: every text the engine exposed reached the client, in order.
    assert lockstep.missed is None, f"the server never sent {lockstep.missed!r}"
    assert _distinct(prefixes) == _distinct(exposed)
