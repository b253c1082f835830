"""Structured output fields → llguidance grammars, and the 400s for bad ones (no sockets)."""

from __future__ import annotations

import pytest

from services.frontend.request_error import RequestError
from services.frontend.structured_output import (MAX_GRAMMAR_BYTES, MAX_GUIDED_CHOICES, checked_grammar,
                                                 output_constraint)

pytestmark = pytest.mark.timeout(30)

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


def grammar_of(body):
    constraint = output_constraint(body)
    return checked_grammar(constraint.grammar, constraint.param)


def refuses(body, param, *words):
    with pytest.raises(RequestError) as info:
        grammar_of(body)
    assert info.value.param == param and info.value.http_status == 400, info.value.message
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}},
    {"guided_json": SCHEMA}, {"guided_json": '{"type": "object", "properties": {"color": {"enum": ["red", "green"]}, '
                                             '"ok": {"type": "boolean"}}, "required": ["color", "ok"]}'},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_a_json_schema_lets_through_json_that_satisfies_it_in_one_whitespace(body, matching):
    grammar = grammar_of(body)
    assert matching.accepts(grammar, '{"color": "red", "ok": true}')
    assert not matching.accepts(grammar, '{"color": "pink", "ok": true}')  # not in the enum
    assert not matching.accepts(grammar, '{"color": "red", "ok": "yes"}')  # not a boolean
    assert not matching.accepts(grammar, '{"color": "red"}')  # ok is required
    assert not matching.accepts(grammar, 'Sure! {"color": "red", "ok": true}')
    # JSON_WHITESPACE: ", " and ": " only, so that a model cannot loop on whitespace
    assert not matching.accepts(grammar, '{"color":"red","ok":true}')
    assert not matching.accepts(grammar, '{ "color": "red", "ok": true }')
    assert not matching.accepts(grammar, '{"color": "red",\n"ok": true}')


@pytest.mark.parametrize("body", [{"response_format": {"type": "json_object"}},
                                  {"structured_outputs": {"json_object": True}}])
def test_json_object_is_any_json_object(body, matching):
    grammar = grammar_of(body)
    assert matching.accepts(grammar, '{"a": [1, 2.5, null], "b": {"c": "d"}}')
    assert not matching.accepts(grammar, "[1, 2]") and not matching.accepts(grammar, "hello")


def test_text_is_no_constraint():
    assert output_constraint({"response_format": {"type": "text"}}) is None
    assert output_constraint({"guided_json": None, "structured_outputs": None}) is None


@pytest.mark.parametrize("body", [{"guided_regex": "[0-9]{3}-[a-z]+"}, {"structured_outputs": {"regex": "[0-9]{3}-[a-z]+"}}])
def test_a_regex(body, matching):
    grammar = grammar_of(body)
    assert matching.accepts(grammar, "123-abc") and not matching.accepts(grammar, "12-abc")


@pytest.mark.parametrize("body", [{"guided_choice": ["yes", "no", 'a "quoted"\\ é\nline']},
                                  {"structured_outputs": {"choice": ["yes", "no", 'a "quoted"\\ é\nline']}}])
def test_a_choice_is_exactly_one_of_its_strings(body, matching):
    grammar = grammar_of(body)
    for text in ("yes", "no", 'a "quoted"\\ é\nline'):
        assert matching.accepts(grammar, text)
    assert not matching.accepts(grammar, "maybe") and not matching.accepts(grammar, "yesno")


@pytest.mark.parametrize("body", [{"guided_grammar": 'start: "(" NUMBER ")"\nNUMBER: /[0-9]+/'},
                                  {"structured_outputs": {"grammar": 'start: "(" NUMBER ")"\nNUMBER: /[0-9]+/'}}])
def test_a_lark_grammar(body, matching):
    grammar = grammar_of(body)
    assert matching.accepts(grammar, "(42)") and not matching.accepts(grammar, "(4a)")


@pytest.mark.parametrize("body, param, words", [
    ({"guided_json": {"type": "bogus"}}, "guided_json", ["not a valid constraint", "bogus"]),
    ({"guided_json": "{not json"}, "guided_json", ["valid JSON"]),
    ({"guided_json": [1]}, "guided_json", ["JSON schema", "an array"]),
    ({"guided_json": {"type": "string", "pattern": "("}}, "guided_json", ["regex"]),
    ({"guided_regex": "a(b"}, "guided_regex", ["unclosed group"]),
    ({"guided_regex": ""}, "guided_regex", ["non-empty string"]),
    ({"guided_grammar": "start: foo"}, "guided_grammar", ["unknown name", "foo"]),
    ({"guided_grammar": 5}, "guided_grammar", ["non-empty string", "number 5"]),
    ({"guided_choice": []}, "guided_choice", ["1 to 256 strings", "0 items"]),
    ({"guided_choice": "yes"}, "guided_choice", ["list"]),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]", ["guided_choice[1]", "number 1"]),
    ({"guided_choice": ["a", ""]}, "guided_choice[1]", ["guided_choice[1]", "1 to 1024"]),
    ({"guided_choice": ["a", "x" * 1025]}, "guided_choice[1]", ["guided_choice[1]", "1025 characters"]),
    ({"guided_choice": ["x"] * (MAX_GUIDED_CHOICES + 1)}, "guided_choice", ["257 items"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", ["required", "64 characters"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", ["'a b'"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name", ["65 characters"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
     "response_format.json_schema.schema", ["an object", "a string"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema", ["null"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", ["true or false"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format", ["not a valid constraint", "nope"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["name and schema", "null"]),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ["'yaml'"]),
    ({"response_format": {}}, "response_format.type", ["null"]),
    ({"response_format": ["json"]}, "response_format", ["an array"]),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", ["exactly one", "json, regex"]),
    ({"structured_outputs": {}}, "structured_outputs", ["exactly one", "none"]),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", ["not supported"]),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", ["expected true"]),
    ({"structured_outputs": "json"}, "structured_outputs", ["an object", "a string"]),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", ["unclosed group"]),
])
def test_bad_constraints_are_400s_naming_the_field(body, param, words):
    refuses(body, param, *words)


@pytest.mark.parametrize("body, first, second", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format", "guided_regex"),
    ({"guided_json": {}, "guided_choice": ["a"]}, "guided_json", "guided_choice"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "structured_outputs.regex"),
])
def test_two_constraints_are_a_400_naming_both(body, first, second):
    refuses(body, second, first, second, "only one")


def test_a_grammar_past_the_instances_limit_is_a_400():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_GRAMMAR_BYTES // 20)}}
    refuses({"guided_json": schema}, "guided_json", "bytes", str(MAX_GRAMMAR_BYTES))


def test_a_schema_nested_past_what_llguidance_reads_is_a_400_not_a_crash():
    schema = {"type": "object"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    refuses({"guided_json": schema}, "guided_json", "JSON schema")
