"""Request bodies of /v1/completions and /v1/chat/completions fuzzed through the real app (the tiny model's
tokenizer and chat template, hermes tool calls): valid bodies with fields set to wrong types, huge numbers, NaN,
nested nulls, empty lists, deep nesting. Every answer is a 200 or a 4xx with an OpenAI error body, never a 500,
streamed or not; and every request that reaches the instance is one it takes (its proto, checked as the
instance checks it)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from services.frontend.convert import generate_request_to_proto
from services.frontend.dispatch import Dispatcher
from services.frontend.generation import FinishReason, TokenChunk
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_runner import RequestRunner
from services.frontend.served_model import ServedModel
from services.frontend.server import FrontendServer
from services.frontend.tool_calls import ToolCallFormat
from services.instance.convert import sampling_from_proto
from tests.loopback_http import served_on_loopback
from tests.unit.frontend.factories import FakeMembership, entry

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 64
NUM_BODIES = 600
DEEP = "[" * 5000 + "]" * 5000


def deep_schema(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


WEIRD = [None, True, False, 0, -1, 1, 2, 1.5, -0.0, 1e308, -1e308, 2**31, 2**63, 2**64, 2**70, -2**70,
         float("nan"), float("inf"), float("-inf"), 1e-320, "", "a", "null", "\ud800", "\x00", "x" * 300, [], [None], [1], [[]], [""],
         {}, {"a": None}, [1, 2.5], {"type": None}, {"type": "function"}]
DEEPER = [DEEP, deep_schema(600), [{"type": "function", "function": {"name": "f", "parameters": deep_schema(600)}}],
          {"name": "f", "parameters": deep_schema(600)}]  # nested deeper than parts of the frontend recurse
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo", "best_of",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "min_tokens", "min_p", "repetition_penalty",
          "stop_token_ids", "ignore_eos", "return_token_ids", "priority", "truncate_prompt_tokens",
          "add_special_tokens", "prompt_logprobs", "cache_salt", "tools", "tool_choice", "parallel_tool_calls",
          "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
          "chat_template_kwargs", "continue_final_message", "return_tokens_as_token_ids", "request_id"]
NESTED_FIELDS = ["messages", "tools", "response_format", "guided_json", "structured_outputs", "chat_template_kwargs",
                 "logit_bias"]  # where JSON nests
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}}
VALID = [{}, {"logit_bias": {"1": 5}}, {"stop": ["x", "y"]}, {"stream": True, "stream_options": {"include_usage": True}},
         {"n": 2, "seed": 3}, {"min_tokens": 2, "max_tokens": 4}, {"stop_token_ids": [1, 2]},
         {"guided_choice": ["a", "b"]}, {"guided_regex": "[a-z]+"}, {"guided_json": {"type": "string"}},
         {"structured_outputs": {"json": "{\"type\": \"string\"}"}},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}]
COMPLETIONS = [{"prompt": "ab"}, {"prompt": [1, 2, 3]}, {"prompt": ["ab", [1, 2]]}, {"prompt": "ab", "echo": True,
               "max_tokens": 0, "logprobs": 1}, {"prompt": "ab", "truncate_prompt_tokens": 1}]
CHATS = [{"messages": [{"role": "user", "content": "hi"}]},
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "tools": [TOOL]},
         {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "required"},
         {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": [TOOL]}]


class CheckingInstance:
    """Answers every request with three tokens, after checking it as the instance would (InvalidArgument)."""

    def __init__(self) -> None:
        self.refused: list[tuple[object, Exception]] = []

    async def generate(self, target, spec):
        request = generate_request_to_proto(spec)
        try:
            sampling_from_proto(request.sampling).validate(MAX_MODEL_LEN, len(request.prompt_token_ids))
        except Exception as exc:
            self.refused.append((spec, exc))
            raise
        yield TokenChunk(0, (5, 6), "ab", None)
        yield TokenChunk(2, (7,), "c", FinishReason.STOP)

    async def attach(self, target, request_id, from_token_index, epoch):
        raise AssertionError("no hand-offs here")
        yield

    def abort_soon(self, target, request_id, copy=None):
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def weird(rng: random.Random):
    return _copied(rng.choice(DEEPER if rng.random() < 0.25 else WEIRD))


def _copied(value):
    return json.loads(json.dumps(value))  # copy.deepcopy recurses a few frames a level: too deep for deep_schema


def mutated(rng: random.Random, body: dict) -> dict:
    """`body` with one or two fields set to weird values, or one value somewhere inside it replaced."""
    body = _copied(body)
    for _ in range(rng.choice([0, 1, 1, 2])):
        body[rng.choice(NESTED_FIELDS if rng.random() < 0.5 else FIELDS)] = weird(rng)
    node = body
    for _ in range(6 if rng.random() < 0.6 else 0):
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            break
        key = rng.choice(keys)
        if not isinstance(node[key], (dict, list)) or rng.random() < 0.3:
            node[key] = weird(rng)
            break
        node = node[key]
    return body


async def test_fuzzed_bodies_get_a_200_or_a_400_and_reach_the_instance_only_as_it_takes_them(tiny_model_dir):
    model = ServedModel.load(tiny_model_dir, "m", max_model_len=MAX_MODEL_LEN).with_tool_calls(ToolCallFormat.HERMES)
    dispatcher = Dispatcher(None, FakeMembership(entry("a")), cooldown_s=5)
    instance = CheckingInstance()
    server = FrontendServer(model, RequestRunner(dispatcher, instance, max_resumes=0), dispatcher, FrontendMetrics(),
                            api_keys=(), max_inflight=64, max_body_bytes=1 << 20)
    rng, statuses, failures = random.Random(0), {}, []
    async with served_on_loopback(server.app()) as base_url, aiohttp.ClientSession() as session:
        for _ in range(NUM_BODIES):
            is_chat = rng.random() < 0.5
            body = {"model": "m", **rng.choice(CHATS if is_chat else COMPLETIONS), **rng.choice(VALID)}
            body = mutated(rng, {**body, "stream": rng.random() < 0.4})
            route = "/v1/chat/completions" if is_chat else "/v1/completions"
            async with session.post(base_url + route, data=json.dumps(body)) as response:
                status, text = response.status, await response.text()
            statuses[status] = statuses.get(status, 0) + 1
            is_answered = ('"error"' not in text) if status == 200 else "error" in json.loads(text)  # not an SSE error
            if status >= 500 or not is_answered or instance.refused:
                failures.append((route, json.dumps(body)[:300], status, text[:300], instance.refused[-1:]))
                instance.refused.clear()
    assert not failures, failures[:5]
    assert statuses.get(200, 0) > NUM_BODIES // 10 and statuses.get(400, 0) > NUM_BODIES // 2, statuses
