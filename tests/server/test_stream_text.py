"""The server streams exactly the engine's text (issue 10, item 3): the engine's detokenizer
owns the stop-string hold-back, so every streamed prefix is a text the engine itself exposed
after some step -- the server holds nothing back of its own (it used to hold back
``len(stop) - 1`` characters more)."""

from __future__ import annotations

import json

import httpx

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts

from .conftest import running_server
from .test_api import POOL

PROMPT_IDS = [5, 17, 42, 9]
STOP = "zqxj"  # 4 characters that the random model's text never contains
MAX_TOKENS = 24


def _engine_texts(loaded) -> list[str]:
    """Sample 0's text after every step of the engine on its own."""
    config = EngineConfig(log_startup=False, **POOL)
    engine = LLMEngine(config, parts=build_parts(config, loaded))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=(STOP,), ignore_eos=True)
    return [out.outputs[0].text for _, out in engine.stream(PROMPT_IDS, params)]


def test_streamed_text_is_always_the_engines_exposed_text(tiny_loaded):
    exposed = _engine_texts(tiny_loaded)
    assert len(exposed[-1]) > 8  # enough text for a hold-back to show
    body = {"prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": STOP,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with (
        running_server(tiny_loaded, **POOL) as (url, _),
        httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r,
    ):
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    sent, prefixes = "", []
    for line in lines:
        sent += json.loads(line)["choices"][0]["text"]
        prefixes.append(sent)
    assert sent == exposed[-1]
    not_exposed = [p for p in prefixes if p not in exposed]
    assert not not_exposed, f"streamed text the engine never exposed: {not_exposed[:3]}"
    # Streamed as it is made, not all at the end. How many steps share a chunk depends on how
    # fast the client reads (a busy machine coalesces them), so only "more than one" is a
    # property of the server rather than of the machine's load.
    assert len(set(prefixes)) >= 2
