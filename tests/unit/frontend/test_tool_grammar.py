"""Forced tool calls: the grammar lets through exactly the calls the request allows, in the
model's format, and ferry's parser reads what it lets through as those calls (no sockets)."""

from __future__ import annotations

import json

import pytest

from services.frontend.request_error import RequestError
from services.frontend.structured_output import output_constraint
from services.frontend.tool_calls import ToolCallFormat, ToolCallParser
from services.frontend.tool_grammar import tool_call_grammar
from services.frontend.tool_protocol import tool_use

pytestmark = pytest.mark.timeout(30)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "$defs": {"Zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: OpenAI's empty list, arguments {}
TOOLS = [WEATHER, TIME, PING]
HERMES = ToolCallFormat.HERMES
LLAMA3 = ToolCallFormat.LLAMA3_JSON


def hermes_call(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def llama3_call(name, arguments):
    return json.dumps({"name": name, "parameters": arguments})


def grammar(format_=HERMES, **fields):
    return tool_call_grammar(tool_use({"tools": TOOLS, **fields}), format_)


def parsed_calls(format_, text, max_calls=None):
    parsed = ToolCallParser(format_, max_calls).feed(text, is_last=True)
    return parsed.content, [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_required_lets_through_one_or_more_calls_of_any_tool_and_nothing_else(matching):
    required = grammar(tool_choice="required")
    one, two = hermes_call("get_weather", {"city": "Paris", "unit": "C"}), hermes_call("get_time", {"zone": "CET"})
    for text in (one, f"{one}\n{two}", hermes_call("ping", {})):
        assert matching.accepts(required, text), text
    for text in (hermes_call("get_wether", {"city": "Paris"}),  # no such tool
                 hermes_call("get_weather", {"city": "Paris", "unit": "K"}),  # not in the enum
                 hermes_call("get_weather", {"unit": "C"}),  # city is required
                 hermes_call("get_weather", {"city": "Paris", "country": "FR"}),  # no other arguments
                 hermes_call("get_time", {"zone": "PST"}),  # the $ref'd enum holds
                 hermes_call("ping", {"any": [1]}),  # a tool without parameters takes none
                 "It is sunny in Paris.", f"Let me check.\n{one}", f"{one}\nDone.", ""):
        assert not matching.accepts(required, text), text


def test_what_the_grammar_lets_through_parses_as_those_calls(matching):
    text = hermes_call("get_weather", {"city": "Paris", "unit": "C"}) + "\n" + hermes_call("get_time", {"zone": "UTC"})
    assert matching.accepts(grammar(tool_choice="required"), text)
    assert parsed_calls(HERMES, text) == ("", [("get_weather", {"city": "Paris", "unit": "C"}),
                                               ("get_time", {"zone": "UTC"})])
    text = llama3_call("get_weather", {"city": "Rome"}) + "; " + llama3_call("ping", {})
    assert matching.accepts(grammar(LLAMA3, tool_choice="required"), text)
    assert parsed_calls(LLAMA3, text) == ("", [("get_weather", {"city": "Rome"}), ("ping", {})])


def test_without_parallel_tool_calls_required_is_one_call(matching):
    single = grammar(tool_choice="required", parallel_tool_calls=False)
    one = hermes_call("get_weather", {"city": "Paris"})
    assert matching.accepts(single, one) and not matching.accepts(single, f"{one}\n{one}")


def test_a_named_function_is_one_call_of_it(matching):
    named = grammar(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert matching.accepts(named, hermes_call("get_time", {"zone": "UTC"}))
    assert not matching.accepts(named, hermes_call("get_weather", {"city": "Paris"}))
    assert not matching.accepts(named, hermes_call("get_time", {"zone": "UTC"}) + "\n" +
                                hermes_call("get_time", {"zone": "CET"}))
    named = grammar(LLAMA3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text = llama3_call("get_weather", {"city": "Oslo", "unit": "F"})
    assert matching.accepts(named, text) and parsed_calls(LLAMA3, text) == ("", [("get_weather",
                                                                                  {"city": "Oslo", "unit": "F"})])
    assert not matching.accepts(named, hermes_call("get_weather", {"city": "Oslo"}))  # the other format
    assert not matching.accepts(named, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')  # llama3's key


def test_calls_are_written_in_ferrys_json_whitespace(matching):
    required = grammar(tool_choice="required")
    assert not matching.accepts(required, '<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>')
    assert not matching.accepts(required, '<tool_call>\n{"arguments": {}, "name": "ping"}\n</tool_call>')  # name first


@pytest.mark.parametrize("format_, call", [(HERMES, hermes_call), (LLAMA3, llama3_call)])
def test_auto_with_a_json_response_format_is_calls_or_the_answer_in_that_json(format_, call, matching):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    answer = output_constraint({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                                              "schema": schema}}})
    either = tool_call_grammar(tool_use({"tools": TOOLS}), format_, answer)
    assert matching.accepts(either, call("get_weather", {"city": "Paris"}))
    assert matching.accepts(either, '{"answer": 42}') and not matching.accepts(either, '{"answer": "x"}')
    assert not matching.accepts(either, "42")
    assert parsed_calls(format_, '{"answer": 42}') == ('{"answer": 42}', [])


def test_a_parameters_schema_llguidance_refuses_is_a_400_naming_its_tool():
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "("}}}}}
    with pytest.raises(RequestError) as info:
        tool_call_grammar(tool_use({"tools": [WEATHER, bad], "tool_choice": "required"}), HERMES)
    assert info.value.param == "tools[1].function.parameters" and "regex" in info.value.message


def test_the_arguments_key_follows_the_format():
    assert '"arguments"' in grammar(HERMES, tool_choice="required")
    assert '"parameters": {"type": "object", "properties": {"city"' in grammar(LLAMA3, tool_choice="required")


def test_a_tag_the_vocabulary_holds_as_one_added_token_is_taken_by_its_id(tiny_model_dir):
    """Qwen's <tool_call> is an added (not special) token; llguidance reads added tokens shaped
    <...> as special ones, which the literal "<tool_call>" lets through the mask, then refuses."""
    import llguidance
    from tokenizers import AddedToken, Tokenizer
    backend = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    tag_id = backend.token_to_id("<tool_call>")
    tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=tag_id + 1, eos_token=[0])
    text = hermes_call("ping", {})
    assert tokenizer.tokenize_str(text)[0] == tag_id

    def accepts(grammar_text):
        matcher = llguidance.LLMatcher(tokenizer, grammar_text, log_level=0)
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()

    forced = tool_use({"tools": TOOLS, "tool_choice": "required"})
    assert accepts(tool_call_grammar(forced, HERMES, tag_token_ids={"<tool_call>": tag_id}))
    assert not accepts(tool_call_grammar(forced, HERMES))  # llguidance's special reading of the tag


@pytest.mark.parametrize("format_", [ToolCallFormat.MISTRAL, ToolCallFormat.MISTRAL_ARGS])
def test_mistral_forced_calls_in_the_shape_the_template_shows_read_back_as_those_calls(matching, format_):
    def call(name, arguments):
        if format_ is ToolCallFormat.MISTRAL_ARGS:
            return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"
        return json.dumps({"name": name, "arguments": arguments})

    def answer(*calls, space=" "):
        return "".join(calls) if format_ is ToolCallFormat.MISTRAL_ARGS else f"[TOOL_CALLS]{space}[{', '.join(calls)}]"

    required = grammar(format_, tool_choice="required")
    one, two = call("get_weather", {"city": "Paris"}), call("get_time", {"zone": "UTC"})
    for text in (answer(one), answer(one, two), answer(one, space="")):  # sentencepiece models: " [", tekken: "["
        assert matching.accepts(required, text), text
        assert parsed_calls(format_, text)[1][0] == ("get_weather", {"city": "Paris"})
    bare = one.removeprefix("[TOOL_CALLS]")  # a call without the marker
    for text in (answer(call("get_weather", {"city": "Paris", "unit": "K"})), bare, f"Sure. {answer(one)}", ""):
        assert not matching.accepts(required, text), text
    named = grammar(format_, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert matching.accepts(named, answer(two)) and not matching.accepts(named, answer(one))


def test_refs_inside_parameters_point_into_them_not_into_the_call_object(matching):
    """Found by a review: "#" and "#/properties/..." resolved against the {name, arguments} wrapper."""
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}},
                                         "w": {"$ref": "#/properties/v"}},
        "required": ["v"], "additionalProperties": False}}}
    required = tool_call_grammar(tool_use({"tools": [tree], "tool_choice": "required"}), HERMES)
    assert matching.accepts(required, hermes_call("tree", {"v": 1, "kids": [{"v": 2, "kids": []}], "w": 3}))
    assert not matching.accepts(required, hermes_call("tree", {"v": 1, "kids": [{"name": "tree", "arguments": {}}]}))
    assert not matching.accepts(required, hermes_call("tree", {"v": 1, "w": "three"}))
