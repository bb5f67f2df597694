"""One request's grammar never touches another's (issue 53).

A batch of constrained requests runs beside one whose grammar fails inside the step, synchronous
and one step ahead: every other request must get exactly the text it gets when it runs alone
(seeded draws depend only on (seed, position), so the reference is exact), the failing one ends
with its own error, and nothing leaks. The failure is injected two ways: into one row's grammar
(its matcher refuses its third token, as a lexer out of fuel does) and into the whole draw of
the step (every entry retried alone). Before the fix the first one advanced the matchers of the
rows ahead of the failing one twice and their JSON lost its opening brace.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import pagedkv.engine.step.draws as sample_step
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.engine.structured.grammar import GrammarCache
from pagedkv.engine.structured.spec import StructuredOutput

from ..conftest import assert_no_leaks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
PROMPT = [5, 17, 40, 99, 12]
POISON = "poison"  # the param of the spec whose matchers fail


class FailingMatcher:
    """An llguidance matcher that refuses its ``fail_at``-th token, as a real one does when its
    lexer runs out of fuel (``consume_token`` False, an error set)."""

    def __init__(self, real, fail_at: int = 3) -> None:
        self._real, self._left = real, fail_at

    def consume_token(self, token: int) -> bool:
        self._left -= 1
        if self._left == 0:
            return False
        return self._real.consume_token(token)

    def get_error(self) -> str:
        return "lexer error: injected"

    def __getattr__(self, name):
        return getattr(self._real, name)


def _engine(tiny_long, ahead: bool) -> LLMEngine:
    config = EngineConfig(log_startup=False, max_model_len=512, block_size=16,
                          async_scheduling=ahead)  # fmt: skip
    return LLMEngine(config, parts=build_parts(config, tiny_long))


def _params(seed: int, param: str = "response_format.json_schema.schema") -> SamplingParams:
    spec = StructuredOutput.of_schema(SCHEMA, param)
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured=spec)


def _run(engine: LLMEngine, requests: list[SamplingParams]) -> list:
    ids = [engine.add_request(PROMPT, p) for p in requests]
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.allocator.check_invariants()
        if not engine.has_unfinished():
            break
    assert_no_leaks(engine)
    return [done[i] for i in ids]


@pytest.fixture
def poisoned_matchers(monkeypatch):
    real = GrammarCache.matchers

    def matchers(self, spec, n):
        made = real(self, spec, n)
        if spec is not None and spec.param == POISON:
            return [FailingMatcher(m) for m in made]
        return made

    monkeypatch.setattr(GrammarCache, "matchers", matchers)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_a_failing_grammar_row_leaves_the_others_text_as_alone(tiny_long, poisoned_matchers, ahead):
    seeds = [30, 31, 32, 33]
    alone = [_run(_engine(tiny_long, ahead), [_params(s)])[0].outputs[0].text for s in seeds]
    # The failing request last: the rows before it in the step are the ones it used to corrupt.
    outs = _run(_engine(tiny_long, ahead), [*map(_params, seeds), _params(34, POISON)])
    assert [o.outputs[0].text for o in outs[:4]] == alone
    for o in outs[:4]:
        assert o.error is None and o.outputs[0].text.startswith("{")
        if o.outputs[0].finish_reason == "stop":  # a random model may write digits to the end
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert outs[4].error and "lexer error: injected" in outs[4].error
    assert outs[4].outputs[0].finish_reason == "error"


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_a_failing_draw_leaves_every_grammar_as_its_text_says(tiny_long, monkeypatch, ahead):
    seeds = [40, 41, 42]
    alone = [_run(_engine(tiny_long, ahead), [_params(s)])[0].outputs[0].text for s in seeds]
    real_draw, calls = sample_step.draw, [0]

    def draw(logits, params, generators, tokens=None, matchers=None):
        calls[0] += 1
        if len(params) > 1 and calls[0] % 3 == 0:  # every third batch draw, retried alone
            raise RuntimeError("injected draw failure")
        return real_draw(logits, params, generators, tokens, matchers)

    monkeypatch.setattr(sample_step, "draw", draw)
    outs = _run(_engine(tiny_long, ahead), [_params(s) for s in seeds])
    assert calls[0] > 6  # several batch draws failed and were retried
    assert [o.outputs[0].text for o in outs] == alone
    assert all(o.error is None for o in outs)


def test_a_grammar_that_fails_in_a_step_is_not_kept_in_the_cache(tiny_long, poisoned_matchers):
    engine = _engine(tiny_long, False)
    spec = _params(50, POISON).structured
    engine.grammars.compile(spec)
    assert spec in engine.grammars
    (out,) = _run(engine, [_params(50, POISON)])
    assert out.error
    # Its copies shared the prototype's lexer: the next request compiles it afresh.
    assert spec not in engine.grammars
