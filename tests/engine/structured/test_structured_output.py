"""Structured output on a tiny random model, whose unconstrained text is noise: whatever it
samples under a grammar must parse and validate (jsonschema, an independent validator), match
the regex, be one of the choices. Requests without a grammar in the same batch get the tokens
they get alone; refused specs are ``UsageError``s naming the field; no block leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.startup import build_parts
from pagedkv.engine.structured.spec import StructuredOutput
from pagedkv.errors import UsageError

from ..conftest import assert_no_leaks

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
     "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
     "color": {"enum": ["red", "green", "blue"]}}, "required": ["ok", "color"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
     "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
     "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
     "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}}}, "required": ["tags"],
     "additionalProperties": False},
]  # fmt: skip
PROMPT = [5, 17, 40, 99, 12]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pagedkv.model import load_model
    from tests.model import tiny

    folder = tmp_path_factory.mktemp("tiny-llama-structured")
    tiny.make_tiny_model("llama", folder, context_len=512)
    return load_model(folder, progress=False)


def make(tiny) -> LLMEngine:
    config = EngineConfig(log_startup=False, max_model_len=512, block_size=16)
    return LLMEngine(config, parts=build_parts(config, tiny))


def constrained(spec: StructuredOutput, n: int = 4, max_tokens: int = 300) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=11, n=n, structured=spec)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_sampled_json_validates_against_its_schema(tiny, schema):
    engine = make(tiny)
    (out,) = engine.generate([PROMPT], constrained(StructuredOutput.of_schema(schema, "s")))
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # really sampled, not one forced answer
    assert_no_leaks(engine)


def test_regex_choice_and_json_object(tiny):
    engine = make(tiny)
    regex = StructuredOutput("regex", r"[0-9]{3}-[a-c]{2,4}")
    choices = ["alpha", "beta", "gamma delta"]
    outs = engine.generate(
        [PROMPT] * 3,
        [constrained(regex), constrained(StructuredOutput.of_choices(choices, "c")),
         constrained(StructuredOutput("json_object"), max_tokens=400)],
    )  # fmt: skip
    assert all(re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", c.text) for c in outs[0].outputs)
    assert all(c.text in choices for c in outs[1].outputs)
    for c in outs[2].outputs:
        if c.finish_reason == "stop":  # a random model may nest past max_tokens
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.startswith("{")
    assert_no_leaks(engine)


def test_unconstrained_requests_beside_a_grammar_are_unchanged(tiny):
    free = SamplingParams(max_tokens=20, ignore_eos=True)
    (alone,) = make(tiny).generate([PROMPT], free)
    engine = make(tiny)
    spec = StructuredOutput.of_schema(SCHEMAS[0], "s")
    outs = engine.generate([PROMPT, PROMPT, [7, 8, 9]], [constrained(spec), free, free])
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert all(json.loads(c.text) for c in outs[0].outputs)
    assert_no_leaks(engine)


def test_compiled_grammars_are_cached(tiny):
    engine = make(tiny)
    spec = StructuredOutput.of_schema(SCHEMAS[1], "s")
    first = engine.grammars.compile(spec)
    assert engine.grammars.compile(StructuredOutput.of_schema(SCHEMAS[1], "other")) is first


@pytest.mark.parametrize(
    "spec, param",
    [(lambda: StructuredOutput("regex", "(unclosed"), "guided_regex"),
     (lambda: StructuredOutput("json", '{"type": "no-such-type"}'), "guided_json"),
     (lambda: StructuredOutput("grammar", "root ::= undefined_rule"), "guided_grammar")],
)  # fmt: skip
def test_a_spec_xgrammar_refuses_is_a_usage_error(tiny, spec, param):
    engine = make(tiny)
    so = spec()
    so = StructuredOutput(so.kind, so.spec, param)
    with pytest.raises(UsageError) as e:
        engine.add_request(PROMPT, SamplingParams(structured=so))
    assert e.value.param == param
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kind, spec",
    [("yaml", ""), ("json", "{not json"), ("json", "[1, 2]"), ("choice", "[]"),
     ("choice", '["a", 3]'), ("regex", "")],
)  # fmt: skip
def test_malformed_specs_are_refused_at_the_edge(kind, spec):
    with pytest.raises(UsageError) as e:
        StructuredOutput(kind, spec, "structured_outputs")
    assert e.value.param == "structured_outputs"
