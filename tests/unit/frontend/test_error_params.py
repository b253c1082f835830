"""Every field error names the exact path of what is wrong, as a 400 with OpenAI's error body whose `param`
is that path: a list's element (`stop[1]`, `prompt[1][2]`), a nested object's field
(`messages[2].content[0].type`, `tools[0].function.name`). Before, `stop: ["a", 1]` said "stop: expected a
string or a list of strings", and a tool, a content part or a call in a message was named whole."""

from __future__ import annotations

import aiohttp
import pytest

from services.frontend.tool_calls import ToolCallFormat
from tests.unit.frontend.scripted_frontend import ThreadNotingTokenizer, scripted_frontend

pytestmark = pytest.mark.timeout(30)

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f"}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}


def chat(*messages, **fields):
    return "/v1/chat/completions", {"model": "m", "messages": list(messages or [USER]), **fields}


def completion(**fields):
    return "/v1/completions", {"model": "m", "prompt": "ab", **fields}


BAD_BODIES = {  # path (vocabulary: 32 ids): body
    "stop[1]": completion(stop=["a", 1]),
    "stop[2]": completion(stop=["a", "b", ""]),
    "stop": completion(stop=5),
    "prompt[1]": completion(prompt=[1, 40]),
    "prompt[1][2]": completion(prompt=["ab", [1, 2, 40]]),
    "prompt[2]": completion(prompt=[1, 2, 40], truncate_prompt_tokens=2),  # its index in the request
    "prompt[0][1]": completion(prompt=[[1, "x"]]),
    "stop_token_ids[1]": completion(stop_token_ids=[1, 40]),
    "stop_token_ids[2]": completion(stop_token_ids=[1, 2, -1]),
    "logit_bias.1": completion(logit_bias={"1": 200}),
    "logit_bias.40": completion(logit_bias={"1": 1, "40": 1}),
    "logit_bias": completion(logit_bias={"x": 1}),  # the key is wrong: the object holding it
    "modalities[1]": completion(modalities=["text", "audio"]),
    "stream_options.include_usage": completion(stream=True, stream_options={"include_usage": 1}),
    "response_format.type": completion(response_format={"type": "yaml"}),
    "response_format.json_schema.name": completion(response_format={"type": "json_schema",
                                                                    "json_schema": {"schema": {}}}),
    "guided_choice[1]": completion(guided_choice=["a", 1]),
    "structured_outputs.regex": completion(structured_outputs={"regex": 5}),
    "messages[2].content[0].type": chat(USER, {"role": "assistant", "content": "x"},
                                        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}),
    "messages[0].content[1].text": chat({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": 5}]}),
    "messages[0].content[0]": chat({"role": "user", "content": ["hi"]}),
    "messages[1].role": chat(USER, {"role": "wizard", "content": "x"}),
    "messages[1]": chat(USER, "hi"),
    "messages[0].name": chat({**USER, "name": 3}),
    "tools[0].function.name": chat(tools=[{"type": "function", "function": {"name": 5}}]),
    "tools[1].type": chat(tools=[TOOL, {"type": "retrieval", "function": {"name": "g"}}]),
    "tools[0].function": chat(tools=[{"type": "function"}]),
    "tools[1]": chat(tools=[TOOL, "g"]),
    "tools[0].function.parameters": chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
    "tool_choice.function.name": chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": 3}}),
    "tool_choice.type": chat(tools=[TOOL], tool_choice={"type": "tool", "function": {"name": "f"}}),
    "messages[1].tool_calls[0].function.arguments": chat(USER, {**CALLED, "tool_calls": [
        {"function": {"name": "f", "arguments": "{x"}}]}),
    "messages[1].tool_calls[1].function.name": chat(USER, {**CALLED, "tool_calls": [
        *CALLED["tool_calls"], {"function": {"arguments": "{}"}}]}),
    "messages[1].tool_calls[0]": chat(USER, {**CALLED, "tool_calls": ["f"]}),
    "messages[2].tool_call_id": chat(USER, CALLED, {"role": "tool", "content": "1", "tool_call_id": 5}),
    "chat_template_kwargs.add_generation_prompt": chat(chat_template_kwargs={"add_generation_prompt": 1}),
    "chat_template_kwargs.messages": chat(chat_template_kwargs={"messages": []}),
    "tokens[1]": ("/detokenize", {"tokens": [1, "a"]}),
    "tokens[2]": ("/detokenize", {"tokens": [1, 2, 40]}),
}


@pytest.mark.parametrize("param", BAD_BODIES)
async def test_a_bad_field_is_a_400_naming_its_exact_path(param):
    await assert_refused_naming(param, *BAD_BODIES[param])


ONCE_LET_THROUGH = [  # (path, body): each was answered, as if the field were well formed
    ("logit_bias", completion(logit_bias={"1": 5, "01": -5})),  # one token twice: the last key won
    ("logit_bias.1", completion(logit_bias={"1": None})),  # null read as no bias (vLLM refuses it)
    ("tools", completion(tools={"f": 1}, tool_choice="none")),  # tools unchecked under tool_choice "none"
    ("tools[0].function", completion(tools=[{"type": "function"}], tool_choice="none")),
    ("tools", chat(tools={}, tool_choice="none")),  # an empty object read as no tools
    ("tools", chat(tools="")),
]


@pytest.mark.parametrize("param, request_", ONCE_LET_THROUGH)
async def test_a_malformed_field_once_let_through_is_a_400_naming_it(param, request_):
    await assert_refused_naming(param, *request_)


def called(**fields):
    """A chat whose history holds an assistant's tool call: a valid one with `fields` set (None: left out)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for path, value in fields.items():
        holder, key = (call["function"], path.removeprefix("function_")) if path.startswith("function_") else \
            (call, path)
        holder.pop(key) if value is None else holder.__setitem__(key, value)
    return chat(USER, {"role": "assistant", "content": None, "tool_calls": [call]})


CALL = "messages[1].tool_calls[0]"
BAD_TOOL_CALLS = [  # (path, body): each field of a call in the history, checked as OpenAI types it
    (f"{CALL}.type", called(type="tool")),
    (f"{CALL}.type", called(type=5)),
    (f"{CALL}.function.name", called(function_name="")),
    (f"{CALL}.function.name", called(function_name=None)),
    (f"{CALL}.function.arguments", called(function_arguments={"city": "Paris"})),  # an object, not its text
    (f"{CALL}.function.arguments", called(function_arguments=None)),
    (f"{CALL}.function.arguments", called(function_arguments=7)),
    (f"{CALL}.function.arguments", called(function_arguments="[1]")),
    (f"{CALL}.function.arguments", called(function_arguments="[" * 100_000 + "]" * 100_000)),  # was a 500
    (f"{CALL}.function", called(function="f")),
    (f"{CALL}.id", called(id=5)),
    ("tools[0].function.name", chat(tools=[{"type": "function", "function": {"name": ""}}])),
]


@pytest.mark.parametrize("param, request_", BAD_TOOL_CALLS)
async def test_a_bad_tool_call_in_the_history_is_a_400_naming_its_field(param, request_):
    """A call's type was not read (any value passed), its name could be empty, its arguments an object or left out,
    its id any JSON value (dropped), and arguments nested deeper than the JSON parser recurses was a 500."""
    await assert_refused_naming(param, *request_)


async def test_a_well_formed_tool_call_in_the_history_is_taken():
    """The test above changes one field of this call at a time."""
    _, body = called()
    async with scripted_frontend(max_model_len=64, tokenizer=ChatTokenizer()) as base_url, \
            aiohttp.ClientSession() as session:
        async with session.post(base_url + "/tokenize", json=body) as response:
            assert response.status == 200, await response.text()


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP_TEXT = "[" * 100_000 + "]" * 100_000  # deeper than the JSON parser recurses, in a string
DEEP_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": nested_schema(600)}}}}]  # within the body's nesting, not the grammar's
TOO_DEEP = [  # (path, body): were 500s (RecursionError)
    ("guided_json", completion(guided_json=DEEP_TEXT)),
    ("structured_outputs.json", chat(structured_outputs={"json": DEEP_TEXT})),
    ("tools[0].function.parameters", chat(tools=DEEP_TOOLS, tool_choice="required")),
    ("tools[0].function.parameters", chat(tools=DEEP_TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})),
    ("tools[0].function.parameters", chat(tools=DEEP_TOOLS, response_format={"type": "json_object"})),
]


@pytest.mark.parametrize("param, request_", TOO_DEEP)
async def test_json_nested_too_deeply_for_the_frontend_is_a_400_naming_its_field(param, request_):
    """A schema as text nested deeper than json.loads recurses, and tool parameters whose $refs were rebased
    two frames a level, crashed the request with a 500."""
    await assert_refused_naming(param, *request_, tool_call_format=ToolCallFormat.HERMES)


async def assert_refused_naming(param: str, route: str, body: dict, **frontend_options) -> None:
    async with scripted_frontend(max_model_len=64, **frontend_options) as base_url, aiohttp.ClientSession() as session:
        async with session.post(base_url + route, json=body) as response:
            status, answer = response.status, await response.json()
    assert status == 400, answer
    message = answer["error"]["message"]
    assert answer == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    assert message.startswith(f"{param}: "), message


class ChatTokenizer(ThreadNotingTokenizer):
    """Letters a..t; a chat is its messages' contents, joined."""

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, **variables):
        return self.encode("".join(m["content"] for m in messages))


LONG, ROOMY = "a" * 70, "a" * 50  # the context: 64 tokens, one a letter
CONTEXT_OVERFLOWS = {  # param (named first in the message too), what else the message says, body
    "the prompt": ("prompt", "the prompt is 70 tokens", completion(prompt=LONG)),
    "a batch's prompt": ("prompt[1]", "the prompt is 70 tokens", completion(prompt=["ab", LONG])),
    "a batch's prompt, n=2": ("prompt[1]", "the prompt is 70 tokens", completion(prompt=["ab", LONG], n=2)),
    "an echo of the prompt alone": ("prompt", "the prompt is 64 tokens",
                                    completion(prompt="a" * 64, echo=True, max_tokens=0)),
    "the messages": ("messages", "the messages 70 tokens", chat({"role": "user", "content": LONG})),
    "prompt and max_tokens": ("max_tokens", "(50 in the prompt, 20 for the output); reduce max_tokens to at most 14",
                              completion(prompt=ROOMY, max_tokens=20)),
    "a batch's prompt and max_tokens": ("max_tokens", "(50 in prompt[1], 20 for the output)",
                                        completion(prompt=["ab", ROOMY], max_tokens=20)),
    "a batch's prompt and the default max_tokens": (
        "max_tokens", "(50 in prompt[0], 16 for the output, the default max_tokens); set max_tokens to at most 14",
        completion(prompt=[ROOMY, "ab"])),
    "a batch's prompt and max_tokens, n=2": ("max_tokens", "(50 in prompt[1], 20 for the output)",
                                             completion(prompt=["ab", ROOMY], max_tokens=20, n=2)),
    "an echo and max_tokens": ("max_tokens", "(50 in the prompt, 20 for the output)",
                               completion(prompt=ROOMY, echo=True, max_tokens=20)),
    "messages and max_completion_tokens": ("max_completion_tokens", "reduce max_completion_tokens to at most 14",
                                           chat({"role": "user", "content": ROOMY}, max_completion_tokens=20)),
    "min_tokens over a batch's max_tokens": ("min_tokens", "5 is more than max_tokens (4)",
                                             completion(prompt=["ab", "cd"], min_tokens=5, max_tokens=4)),
    "min_tokens over an echo's max_tokens 0": ("min_tokens", "2 is more than max_tokens (0)",
                                               completion(echo=True, max_tokens=0, min_tokens=2)),
    "min_tokens over what the context leaves": ("min_tokens", "20 is more than max_tokens (14, what the context leaves)",
                                                chat({"role": "user", "content": ROOMY}, min_tokens=20)),
}


@pytest.mark.parametrize("case", CONTEXT_OVERFLOWS)
async def test_a_request_over_the_context_names_the_field_to_change_in_message_and_param(case):
    """OpenAI names the field the client should change: the prompt where it alone leaves no room for output,
    max_tokens where prompt and max_tokens together do not fit. A batch's prompt[1] with too many max_tokens was
    a message starting `prompt[1]: ` with param max_tokens, and min_tokens over max_tokens `prompt[0]: min_tokens:`."""
    param, words, (route, body) = CONTEXT_OVERFLOWS[case]
    async with scripted_frontend(max_model_len=64, tokenizer=ChatTokenizer()) as base_url, \
            aiohttp.ClientSession() as session:
        for stream in (False, True):
            async with session.post(base_url + route, json={**body, "stream": stream}) as response:
                status, error = response.status, (await response.json())["error"]
            assert status == 400 and error["param"] == param, error
            assert error["message"].startswith(f"{param}: ") and words in error["message"], error
            assert error["code"] == (None if param == "min_tokens" else "context_length_exceeded"), error
