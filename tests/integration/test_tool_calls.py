"""Tool calls end to end: a real instance process running a model whose greedy answer is a
hermes tool call (tests/scripted_model.py), a real etcd, the frontend process, and the
`openai` client reading the calls, whole and streamed; and calls forced by tool_choice, and
a structured output answer, through the engine's constrained decoding."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest


from tests.integration.metrics_scrape import sample_value
from tests.integration.scripted_serving import openai_client, serving
from tests.scripted_model import build_scripted_model

pytestmark = pytest.mark.timeout(120)

QWEN_LIKE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCRIPT = ["Checking.\n", "<tool_call>", '\n{"name": "get_weather", "arguments": ', '{"city": "Paris", "unit": "C"}}',
          "\n</tool_call>"]
ANSWER = "".join(SCRIPT)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "scripted"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("models") / MODEL, SCRIPT, QWEN_LIKE_TEMPLATE)


@pytest.fixture(scope="module")
def frontend(etcd, model_dir, tmp_path_factory):
    with serving("tools", etcd, model_dir, tmp_path_factory.mktemp("logs")) as frontend:
        yield frontend


@pytest.fixture
async def client(frontend):
    async with openai_client(frontend) as client:
        yield client


async def test_the_answers_tool_call_comes_back_as_tool_calls(client):
    completion = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0,
                                                      extra_body={"return_token_ids": True})
    (choice,) = completion.choices
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert len(choice.model_dump()["token_ids"]) == len(SCRIPT) + 1  # every piece, then end-of-sequence


async def test_a_streamed_tool_call_says_what_the_whole_answer_says(client):
    stream = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0,
                                                  stream=True, n=2, extra_body={"return_token_ids": True})
    content, calls, finish, token_ids = {0: ""}, {}, {}, {}
    async for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                calls.setdefault(choice.index, []).append((call.index, call.function.name, call.function.arguments))
            token_ids.setdefault(choice.index, []).extend(choice.model_dump().get("token_ids") or [])
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    for index in (0, 1):
        assert content[index] == "Checking."
        ((call_index, name, arguments),) = calls[index]
        assert (call_index, name, json.loads(arguments)) == (0, "get_weather", {"city": "Paris", "unit": "C"})
        assert finish[index] == "tool_calls" and len(token_ids[index]) == len(SCRIPT) + 1


async def test_tool_choice_none_shows_the_tools_and_parses_nothing(client):
    completion = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="none",
                                                      temperature=0)
    assert completion.choices[0].message.content == ANSWER and completion.choices[0].message.tool_calls is None
    assert completion.choices[0].finish_reason == "stop"


async def test_the_call_and_its_result_in_the_history_reach_the_chat_template(frontend):
    messages = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    async with aiohttp.ClientSession(base_url=frontend.address, timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS}) as response:
            assert response.status == 200, await response.text()
            tokens = (await response.json())["tokens"]
        async with http.post("/detokenize", json={"model": MODEL, "tokens": tokens}) as response:
            prompt = (await response.json())["prompt"]
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
        assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0}
        async with http.post("/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["choices"][0]["finish_reason"] == "tool_calls"


# ---- constrained decoding: the engine's grammar (structured_output.py, tool_grammar.py) ----------------------
# The scripted model's own answer is not what these ask for: every token is the grammar's choice. Enums and
# booleans keep the answers short whatever the weights prefer.

SETTINGS = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "verbose": {"type": "boolean"}},
            "required": ["unit", "verbose"], "additionalProperties": False}
SET_UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": SETTINGS}}


def satisfies_settings(value):
    return isinstance(value, dict) and set(value) == {"unit", "verbose"} and value["unit"] in ("C", "F") \
        and isinstance(value["verbose"], bool)


async def test_a_json_schema_response_format_answers_json_that_satisfies_it(client):
    completion = await client.chat.completions.create(
        model=MODEL, messages=WEATHER, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "settings", "schema": SETTINGS}})
    (choice,) = completion.choices
    assert satisfies_settings(json.loads(choice.message.content)), choice.message.content
    assert choice.finish_reason == "stop"  # the grammar completed, not max_tokens


async def test_a_named_tool_choice_forces_a_call_of_that_tool_with_arguments_of_its_schema(client):
    completion = await client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=[*TOOLS, SET_UNIT], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "set_unit"}})
    (choice,) = completion.choices
    assert choice.message.tool_calls, (choice.message.content, choice.finish_reason, completion.model_dump())
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_unit" and satisfies_settings(json.loads(call.function.arguments))
    assert choice.message.content is None and choice.finish_reason == "tool_calls"


async def test_constrained_requests_are_counted_by_the_field_that_asked(client, frontend):
    def count(field: str) -> float:
        return sample_value(int(frontend.address.rsplit(":", 1)[1]),
                            f'ferry_frontend_constrained_requests_total{{field="{field}"}}')
    before = {field: count(field) for field in ("guided_choice", "tool_choice")}
    await client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": ["yes", "no"]})
    await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=[*TOOLS, SET_UNIT], max_tokens=64,
                                         temperature=0, tool_choice="required")
    assert {field: count(field) - before[field] for field in before} == {"guided_choice": 1, "tool_choice": 1}


async def test_a_named_tool_choice_naming_no_tool_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS,
                                             tool_choice={"type": "function", "function": {"name": "set_unit"}})
    assert info.value.body["param"] == "tool_choice.function.name" and "'set_unit'" in info.value.body["message"]
