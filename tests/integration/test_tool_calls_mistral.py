"""Mistral tool calls end to end: a real instance runs a model whose greedy answer is
`Checking.[TOOL_CALLS] [{...}]`, [TOOL_CALLS] a special token (left out of the text a client
sees), and the frontend reads the call from it, whole and streamed; a call forced by
tool_choice takes the marker by its token id; the call ids are the 9 letters and digits
Mistral's templates require when the call comes back in the history."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.test_tool_calls import SET_UNIT, TOOLS, WEATHER, satisfies_settings
from tests.integration.scripted_serving import openai_client, serving
from tests.scripted_model import build_scripted_model

pytestmark = pytest.mark.timeout(120)

MISTRAL_LIKE_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}"
    "{%- if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{%- endif %}"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}"
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS] {{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}</s>{%- endif %}{%- endfor %}"
)
MARKER = "[TOOL_CALLS]"
SCRIPT = ["Checking.", MARKER, ' [{"name": "get_weather", "arguments": ', '{"city": "Paris", "unit": "C"}}]']
MODEL = "scripted-mistral"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("models") / MODEL, SCRIPT, MISTRAL_LIKE_TEMPLATE,
                                special=[MARKER])


@pytest.fixture(scope="module")
def frontend(etcd, model_dir, tmp_path_factory):
    with serving("mistral", etcd, model_dir, tmp_path_factory.mktemp("logs")) as frontend:
        yield frontend


@pytest.fixture
async def client(frontend):
    async with openai_client(frontend) as client:
        yield client


async def test_the_call_after_the_special_marker_comes_back_as_tool_calls_with_mistral_ids(client):
    completion = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0)
    (choice,) = completion.choices
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert len(call.id) == 9 and call.id.isalnum()
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"


async def test_a_streamed_call_says_what_the_whole_answer_says(client):
    stream = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0,
                                                  stream=True, n=2)
    content, calls, finish = {}, {}, {}
    async for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                calls.setdefault(choice.index, []).append((call.function.name, json.loads(call.function.arguments)))
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    for index in (0, 1):
        assert content[index] == "Checking." and finish[index] == "tool_calls"
        assert calls[index] == [("get_weather", {"city": "Paris", "unit": "C"})]


async def test_without_reading_calls_the_marker_stays_out_of_the_text(client):
    completion = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="none",
                                                      temperature=0)
    assert completion.choices[0].message.content == "".join(piece for piece in SCRIPT if piece != MARKER)


async def test_the_returned_call_id_passes_the_templates_check_in_the_history(client):
    first = await client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    answer = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls"
    history[1]["tool_calls"][0]["id"] = "call_1"
    with pytest.raises(openai.BadRequestError, match="length 9"):
        await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0)


async def test_a_named_tool_choice_forces_the_marker_and_a_call_of_that_tool(client):
    completion = await client.chat.completions.create(
        model=MODEL, messages=WEATHER, tools=[*TOOLS, SET_UNIT], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "set_unit"}}, extra_body={"return_token_ids": True})
    (choice,) = completion.choices
    assert choice.message.tool_calls, (choice.message.content, choice.finish_reason)
    (call,) = choice.message.tool_calls
    assert call.function.name == "set_unit" and satisfies_settings(json.loads(call.function.arguments))
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
