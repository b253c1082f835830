"""Every field error names the exact path of what is wrong, as a 400 with OpenAI's error body whose `param`
is that path: a list's element (`stop[1]`, `prompt[1][2]`), a nested object's field
(`messages[2].content[0].type`, `tools[0].function.name`). Before, `stop: ["a", 1]` said "stop: expected a
string or a list of strings", and a tool, a content part or a call in a message was named whole."""

from __future__ import annotations

import aiohttp
import pytest

from tests.unit.frontend.scripted_frontend import scripted_frontend

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
    route, body = BAD_BODIES[param]
    async with scripted_frontend(max_model_len=64) as base_url, aiohttp.ClientSession() as session:
        async with session.post(base_url + route, json=body) as response:
            status, answer = response.status, await response.json()
    assert status == 400, answer
    message = answer["error"]["message"]
    assert answer == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    assert message.startswith(f"{param}: "), message
