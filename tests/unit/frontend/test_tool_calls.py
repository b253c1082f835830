"""Tool calls read out of chat answers (hermes, llama3_json and mistral), whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from services.frontend.tool_calls import (Parsed, ToolCallFormat, ToolCallParser, ToolCallParserSetting,
                                          detect_format)

pytestmark = pytest.mark.timeout(30)

HERMES, LLAMA3 = ToolCallFormat.HERMES, ToolCallFormat.LLAMA3_JSON
MISTRAL, MISTRAL_ARGS = ToolCallFormat.MISTRAL, ToolCallFormat.MISTRAL_ARGS
MISTRAL_TEMPLATE = ('{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}'
                    '{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS] {{ m.tool_calls | tojson }}'
                    '{%- else %}{{ m.content }}{%- endif %}{%- endfor %}')
MISTRAL_ARGS_TEMPLATE = '{%- for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments }}'
QWEN_TEMPLATE = ("{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\nFor each "
                 "function call, return a json object within <tool_call></tool_call> XML tags{% endif %}")
LLAMA3_TEMPLATE = ('{%- if tools %}Environment: ipython\nRespond in the format {"name": function name, '
                   '"parameters": dictionary of argument name and its value}{%- endif %}<|python_tag|>')


def whole(format_: ToolCallFormat, text: str, max_calls: int | None = None) -> Parsed:
    return ToolCallParser(format_, max_calls).feed(text, is_last=True)


def streamed(format_: ToolCallFormat, pieces: list[str]) -> Parsed:
    parser = ToolCallParser(format_)
    results = [parser.feed(piece, is_last=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return Parsed("".join(r.content for r in results), tuple(c for r in results for c in r.tool_calls))


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_the_format_is_read_from_the_chat_template():
    assert detect_format(QWEN_TEMPLATE) is HERMES
    assert detect_format(LLAMA3_TEMPLATE) is LLAMA3
    assert detect_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None
    assert ToolCallParserSetting.AUTO.format_for(QWEN_TEMPLATE) is HERMES
    assert ToolCallParserSetting.LLAMA3_JSON.format_for(None) is LLAMA3
    assert ToolCallParserSetting.NONE.format_for(QWEN_TEMPLATE) is None
    assert detect_format(MISTRAL_TEMPLATE) is MISTRAL and detect_format(MISTRAL_ARGS_TEMPLATE) is MISTRAL_ARGS
    assert ToolCallParserSetting.MISTRAL.format_for(MISTRAL_ARGS_TEMPLATE) is MISTRAL_ARGS
    assert ToolCallParserSetting.MISTRAL.format_for(None) is MISTRAL


def test_hermes_calls_and_the_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n')
    parsed = whole(HERMES, text)
    assert parsed.content == "Let me look."
    assert calls(parsed) == [("get_weather", {"city": "Paris", "unit": "C"}), ("now", {})]
    ids = [call.id for call in parsed.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_hermes_text_without_calls_is_given_back_exactly():
    for text in ["Paris is the capital.  ", "", " \n", "a < b and <tool x", "ends with <tool_ca"]:
        parsed = whole(HERMES, text)
        assert (parsed.content, parsed.tool_calls) == (text, ())


def test_hermes_a_block_that_is_no_call_stays_content_as_written():
    for text in ["Hi \n<tool_call>not json</tool_call> bye", 'x <tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "<tool_call>{\"name\": \"f\""]:
        parsed = whole(HERMES, text)
        assert (parsed.content, parsed.tool_calls) == (text, ()), text


def test_hermes_an_unclosed_last_call_that_parses_is_a_call_as_vllm_reads_it():
    parsed = whole(HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert (parsed.content, calls(parsed)) == ("", [("f", {"x": 1})])


def test_arguments_are_always_a_json_object_as_clients_parse_them():
    parsed = whole(HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')  # a JSON string
    assert parsed.tool_calls[0].arguments == '{"x": 1}'
    assert whole(HERMES, '<tool_call>{"name": "f", "arguments": null}</tool_call>').tool_calls[0].arguments == "{}"
    assert whole(HERMES, '<tool_call>{"name": "f"}</tool_call>').tool_calls[0].arguments == "{}"
    for bad in ('"not json"', '"[1, 2]"', "[1]"):
        text = '<tool_call>{"name": "f", "arguments": ' + bad + '}</tool_call>'
        assert whole(HERMES, text) == Parsed(text), bad  # not a call: the text stays


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [call.name for call in whole(HERMES, text, max_calls=1).tool_calls] == ["a"]


def test_hermes_streaming_holds_back_what_may_start_a_call():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Sure <tool").content == "Sure"
    assert parser.feed('_call>{"name": "f", ').content == ""
    done = parser.feed('"arguments": {}}</tool_call>')
    assert (done.content, [c.name for c in done.tool_calls]) == ("", ["f"])
    assert parser.feed(" \n", is_last=True) == Parsed("", ())
    assert parser.has_called


def test_mistral_calls_in_either_shape_and_the_text_before_them():
    listed = whole(MISTRAL, 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                            '{"name": "now", "arguments": {}}]')
    assert (listed.content, calls(listed)) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("now", {})])
    args = whole(MISTRAL_ARGS, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}')
    assert (args.content, calls(args)) == ("", [("get_weather", {"city": "Paris"}), ("now", {})])
    ids = [call.id for call in listed.tool_calls + args.tool_calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 4  # as Mistral's templates take them


def test_mistral_text_that_is_no_call_stays_content_as_written():
    for text in ["Paris.", "a [TOOL_CALLS] that is not JSON", "[TOOL_CALLS] [1, 2]", "[TOOL_CALLS]f[ARGS]not json",
                 "ends with [TOOL_CA", ""]:
        parsed = whole(MISTRAL, text)
        assert (parsed.content, parsed.tool_calls) == (text, ()), text


def test_mistral_outputs_real_models_write_read_as_vllm_reads_them():
    """Found checking against mistral-common and vLLM's parser tests: tekken models write no space before the
    list, text may follow it, and name[ARGS] calls may carry empty or null arguments, or none at all."""
    for text, content, expected in [
            ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 3}}]', "", [("add", {"a": 3})]),
            ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3}}]\nextra trailing data', "extra trailing data",
             [("add", {"a": 3})]),
            ("[TOOL_CALLS]ping[ARGS]", "", [("ping", {})]), ("[TOOL_CALLS]ping[ARGS]null", "", [("ping", {})]),
            ("[TOOL_CALLS]toolname_no_args", "", [("toolname_no_args", {})]),
            # found by a review: text after the first of two lists was lost, and text after one joined the content
            ('[TOOL_CALLS] [{"name": "a"}] Note one. [TOOL_CALLS] [{"name": "b"}]', "Note one.", [("a", {}), ("b", {})]),
            ('Hi [TOOL_CALLS] [{"name": "a"}]garbage', "Hi garbage", [("a", {})])]:
        parsed = whole(MISTRAL_ARGS, text)
        assert (parsed.content, calls(parsed)) == (content, expected), text


def test_special_markers_put_back_for_the_parser_leave_content_that_is_no_call():
    """[TOOL_CALLS] and [ARGS] reach the parser only (ServedModel.shown_marker_ids): text that was no call
    comes back as the client sees text, without them."""
    parser = ToolCallParser(MISTRAL_ARGS, hidden_markers=("[TOOL_CALLS]", "[ARGS]"))
    assert parser.feed("Hi [TOOL_CALLS]two words[ARGS]{}", is_last=True) == Parsed("Hi two words{}", ())


@pytest.mark.parametrize("format_,texts", [
    (MISTRAL, ['Sure thing.\n\n[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich 🌧"}}]',
               "Just text, with [brackets] and [TOOL] words  ", "x [TOOL_CALLS] [not json",
               '[TOOL_CALLS]f[ARGS]{"a": [1, 2]}[TOOL_CALLS]g[ARGS]{}', '[TOOL_CALLS][{"name": "f"}] after',
               'Hi [TOOL_CALLS] [{"name": "a"}] x [TOOL_CALLS] [{"name": "b"}]y']),

    (HERMES, ['Thinking about it.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌧"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
              "No tools needed: <tool> is not <tool_call and 2 < 3 >  ",
              "a <tool_call>bad</tool_call>  b\n", '<tool_call>{"name": "f", "arguments": {}}</tool_call> tail']),
    (LLAMA3, ['{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}',
              "  Just text {with braces}", '{"name": "f", "parameters": {}} and then text', "", "   "]),
])
def test_any_split_of_a_stream_says_what_the_whole_answer_says(format_, texts):
    rng = random.Random(0)
    for text in texts:
        expected = whole(format_, text)
        for _ in range(60):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            got = streamed(format_, pieces)
            assert got.content == expected.content, (text, pieces)
            assert [(c.name, c.arguments) for c in got.tool_calls] == \
                   [(c.name, c.arguments) for c in expected.tool_calls]


def test_llama3_json_answers_are_calls_and_other_answers_stream_as_text():
    parsed = whole(LLAMA3, ' {"name": "get_weather", "parameters": {"city": "Paris"}} ; {"name": "now", '
                           '"parameters": {}}')
    assert (parsed.content, calls(parsed)) == ("", [("get_weather", {"city": "Paris"}), ("now", {})])
    parser = ToolCallParser(LLAMA3)
    assert parser.feed(" ").content == ""
    assert parser.feed("Paris").content == " Paris"  # text: given back at once, nothing held
    not_calls = '{"name": "f", "parameters": {}} and then text'
    assert whole(LLAMA3, not_calls) == Parsed(not_calls)
    assert whole(LLAMA3, '{"city": "Paris"}') == Parsed('{"city": "Paris"}')
