"""Structured output end to end on the real bundled model: every output parses and validates."""

from __future__ import annotations

import json
import re

import pytest

from loom import LLM, SamplingParams
from loom.sampling_params import StructuredOutputParams as SO

jsonschema = pytest.importorskip("jsonschema")

NAME = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}  # a small model may otherwise write digits until
# max_tokens: every value here is bounded, so an output that ends is one the grammar let end
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]}}, "required": ["city"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": INT, "y": INT}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "book"}, "title": NAME}, "required": ["kind", "title"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["id"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [INT, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "maxItems": 3}}, "required": ["colors"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": INT, "b": {"type": "string", "maxLength": 10},
                                      "c": {"type": "boolean"}}, "required": ["a", "b", "c"],
     "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
     "required": ["email"], "additionalProperties": False},
    # $defs/$ref, and anyOf between two object shapes (discriminated by a const)
    {"$defs": {"city": {"type": "object", "properties": {"name": NAME, "country": {"enum": ["FR", "IT", "JP"]}},
                        "required": ["name", "country"], "additionalProperties": False}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/city"}, "to": {"$ref": "#/$defs/city"}},
     "required": ["from", "to"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"type": {"const": "circle"}, "radius": INT},
         "required": ["type", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "square"}, "side": INT},
         "required": ["type", "side"], "additionalProperties": False}]}},
     "required": ["shape"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def packed() -> LLM:
    return LLM()  # the bundled Q4_1 model kept packed (the default)


def test_json_schema_outputs_parse_and_validate(packed: LLM) -> None:
    convs = [[{"role": "user", "content": f"Answer in JSON matching this schema: {json.dumps(s)}"}]
             for s in SCHEMAS]
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_output=SO(json=s)) for s in SCHEMAS]
    outs = packed.chat(convs, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert packed.engine.structured.num_matchers == 0
    stats = packed.engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_sampled_outputs_validate_too(packed: LLM) -> None:
    schema = SCHEMAS[0]
    out = packed.chat([[{"role": "user", "content": "A person, as JSON."}]],
                      SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=120, structured_output=SO(json=schema)),
                      use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_choice_regex_grammar_and_json_object(packed: LLM) -> None:
    conv = [[{"role": "user", "content": "Is the sky blue? Then give a phone number."}]]

    def run(spec: SO, max_tokens: int = 60, conv: list = conv) -> str:
        out = packed.chat(conv, SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec),
                          use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", out.text
        return out.text

    assert run(SO(choice=["yes", "no", "it depends"])) in ("yes", "no", "it depends")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", run(SO(regex=r"[0-9]{3}-[0-9]{4}")))
    assert run(SO(grammar='start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"\n')) in (
        "The answer is yes.", "The answer is no.")
    # any JSON object: a 135M model often nests objects until max_tokens; these prompts let it close
    for ask in ['What is the capital of France? Answer as a JSON object like {"capital": "..."}.',
                'Return a JSON object with one key, "color", for the color of grass.']:
        assert isinstance(json.loads(run(SO(json_object=True), 120, [[{"role": "user", "content": ask}]])), dict)


def test_unconstrained_neighbours_are_unchanged(llm: LLM) -> None:
    """A constrained request in the batch does not change the greedy output of the others (float32)."""
    prompts = ["The capital of France is", "Write a haiku about rain."]
    plain = SamplingParams(temperature=0.0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(prompts + ["Name a color:"], [plain, plain, SamplingParams(
        temperature=0.0, max_tokens=16, structured_output=SO(choice=[" red", " blue"]))], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert mixed[2].outputs[0].text in (" red", " blue")


def test_a_bad_constraint_fails_at_add_request_and_keeps_nothing(packed: LLM) -> None:
    with pytest.raises(ValueError, match="structured_output is invalid"):
        packed.engine.add_request("bad", "hi", SamplingParams(structured_output=SO(json={"type": "bogus"})))
    assert not packed.engine.has_unfinished_requests()
