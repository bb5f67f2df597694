"""Forced tool calls' grammars (``server/forced_calls.py``) sampled from random logits under the
engine's masks (random logits reach what a trained model rarely writes), read back by the
answer's own parser: every sample that closed is the calls it should be, with arguments that
``jsonschema`` validates against the parameter schemas closed by hand; which templates get the
wrapper rendered."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedkv.engine.structured.grammar import GrammarCache, accept, apply_masks
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.forced_calls import NAME_HEAD, call_head, forced_calls, hermes_format
from pagedkv.server.structured_params import JsonRules
from pagedkv.server.tools import ToolUse

ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
        "exact": {"type": "boolean"}}, "required": ["zone"]}  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
         {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "ping"}}]  # fmt: skip
BY_HAND = {"get_time": {**ZONE, "additionalProperties": False},
           "get_weather": {**CITY, "additionalProperties": False},
           "ping": {"type": "object", "maxProperties": 0}}  # fmt: skip
SAMPLES = 12
MAX_SAMPLE_TOKENS = 160


@pytest.fixture(scope="module")
def grammars(embedded):
    config, _, tokenizer = embedded
    return GrammarCache(tokenizer, config.vocab_size), tokenizer, config.vocab_size


def sample(grammars, spec, seed: int) -> list[tuple[str, bool]]:
    """(text, whether the sample hit the token cap) of ``SAMPLES`` random samples."""
    cache, tokenizer, vocab_size = grammars
    gen = torch.Generator().manual_seed(seed)
    out = []
    for matcher in cache.matchers(spec, SAMPLES):
        ids, closed = [], False
        for _ in range(MAX_SAMPLE_TOKENS):
            logits = torch.randn(1, vocab_size, generator=gen)
            apply_masks(logits, [matcher])
            ids.append(int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen)))
            if accept(matcher, ids[-1]):
                closed = True
                break
        out.append((tokenizer.decode(ids), not closed))
    return out


@pytest.mark.parametrize(
    "offered, many, rendered",
    [(TOOLS[:1], False, True), (TOOLS, False, True), (TOOLS, True, True), (TOOLS, True, False),
     (TOOLS[1:2], True, True), (TOOLS[2:], False, False)],
)  # fmt: skip
def test_sampled_forced_calls_parse_and_validate(grammars, offered, many, rendered):
    forced = forced_calls(offered, many, rendered, JsonRules())
    names = [t["function"]["name"] for t in offered]
    if rendered:
        assert forced.prefix == (call_head(names[0]) if len(offered) == 1 else NAME_HEAD)
    else:
        assert forced.prefix == ""
    use = ToolUse(TOOLS, parse=True, prefix=forced.prefix)
    seen = 0
    for text, at_length in sample(grammars, forced.grammar, seed=len(names) + 2 * many):
        parsed = use.parse_text(text, at_length=at_length)
        assert parsed.content is None, text  # nothing of a forced call is content
        if not at_length:
            assert parsed.calls and not parsed.cut, text
            assert many or len(parsed.calls) == 1
        for _, name, arguments in parsed.calls:
            assert name in names
            jsonschema.validate(json.loads(arguments), BY_HAND[name])
        seen += len(parsed.calls)
    assert seen >= SAMPLES // 2


def test_the_wrapper_is_rendered_only_where_the_format_is_known(embedded):
    _, _, smollm = embedded  # its template does not render tools: the server's prompt does

    def with_template(template: str) -> Tokenizer:
        return Tokenizer(smollm.backend, chat_template=template, bos_token_id=None,
                         eos_token_id=smollm.eos_token_id, stop_token_ids=())  # fmt: skip

    assert hermes_format(smollm)
    qwen_like = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>\n{{ messages }}</tool_call>"
    assert hermes_format(with_template(qwen_like))
    llama_like = '{% for t in tools %}{{ t }}{% endfor %}{"name": ..., "parameters": ...}'
    assert not hermes_format(with_template(llama_like))
