"""Unknown top-level request fields: ignored (as vLLM does) but said so, or refused with --reject-unknown-fields
(as OpenAI does). Before, a misspelt `max_token` was dropped without a word: the client got an answer as long
as the context allowed and no hint why."""

from __future__ import annotations

import aiohttp
import pytest
from structlog.testing import capture_logs

from services.frontend.openai_protocol import Endpoint, parse_chat_request, parse_completion_request
from services.frontend.generation import FinishReason
from services.frontend.request_error import RequestError
from services.frontend.unknown_fields import (HEADER, KNOWN_FIELDS, MAX_NAMES_LOGGED, MAX_NAMES_SHOWN,
                                              UnknownFieldPolicy, nearest_known, shown_names, unknown_fields)
from tests.unit.frontend.factories import chunk
from tests.unit.frontend.scripted_frontend import scripted_frontend
from tests.unit.frontend.test_prompt_checks import ChatTokenizer

pytestmark = pytest.mark.timeout(30)

# Known, but read by no parser: the server reads request_id (request_ids.py); OpenAI's tags change no answer.
ACCEPTED_UNREAD = {"request_id", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                   "prediction"}
MESSAGES = [{"role": "user", "content": "hi"}]
BODIES = {  # requests that make the parsers read every field they ever read (some only under others)
    Endpoint.COMPLETIONS: [{"prompt": "hi"}, {"prompt": "hi", "stream": True, "echo": True, "logprobs": 2,
                                              "stream_options": {"include_usage": True}}],
    Endpoint.CHAT: [{"messages": MESSAGES},
                    {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                     "tool_choice": "auto", "logprobs": True, "top_logprobs": 2},
                    {"messages": MESSAGES, "response_format": {"type": "json_object"}}],
}
PARSERS = {Endpoint.COMPLETIONS: parse_completion_request, Endpoint.CHAT: parse_chat_request}


class ReadFields(dict):
    """A body that notes every field a parser looks up."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_the_known_fields_are_the_ones_the_parsers_read(endpoint):
    """A field the parser reads but the list lacks would be reported ignored (and refused when strict); one the
    list has but no parser reads would be ignored without a word."""
    read: set[str] = set()
    for body in BODIES[endpoint]:
        recording = ReadFields(body)
        PARSERS[endpoint](recording, "m")
        read |= recording.read
    assert read - KNOWN_FIELDS[endpoint] == set()
    assert KNOWN_FIELDS[endpoint] - read <= ACCEPTED_UNREAD


def test_unknown_fields_and_their_nearest_known_ones():
    assert unknown_fields({"prompt": "x", "max_token": 5, "timeout": 3}, Endpoint.COMPLETIONS) == ["max_token",
                                                                                                  "timeout"]
    assert unknown_fields({"messages": [], "top_logprobs": 2, "metadata": {}}, Endpoint.CHAT) == []
    assert unknown_fields({"prompt": "x", "top_logprobs": 2}, Endpoint.COMPLETIONS) == ["top_logprobs"]  # chat's
    assert nearest_known("max_token", Endpoint.COMPLETIONS) == "max_tokens"
    assert nearest_known("temprature", Endpoint.CHAT) == "temperature"
    assert nearest_known("timeout", Endpoint.CHAT) is None


def test_names_shown_are_visible_ascii_cut_short_and_few():
    assert shown_names(["a b", "é", "x" * 100]) == "a_b, _, " + "x" * 64
    assert shown_names([f"f{i}" for i in range(MAX_NAMES_SHOWN + 1)]).endswith(f"f{MAX_NAMES_SHOWN - 1}, ...")


def test_each_unknown_field_is_logged_once_at_warning():
    policy = UnknownFieldPolicy()
    with capture_logs() as logs:
        for _ in range(3):
            assert policy.check({"prompt": "x", "max_token": 5}, Endpoint.COMPLETIONS) == ["max_token"]
        policy.check({"prompt": "x", "max_token": 5, "timeout": 3}, Endpoint.COMPLETIONS)
    assert [(e["event"], e["log_level"], e["field"], e["did_you_mean"]) for e in logs] == [
        ("unknown_request_fields", "warning", "max_token", "max_tokens"),
        ("unknown_request_fields", "warning", "timeout", None)]


def test_a_flood_of_field_names_logs_a_bounded_number_of_lines():
    policy = UnknownFieldPolicy()
    with capture_logs() as logs:
        for i in range(MAX_NAMES_LOGGED + 50):
            policy.check({"prompt": "x", f"f{i}": 1}, Endpoint.COMPLETIONS)
    assert len(logs) == MAX_NAMES_LOGGED + 1 and logs[-1]["event"] == "unknown_request_fields_not_logged"


def test_strict_refuses_as_openai_does():
    with pytest.raises(RequestError) as info:
        UnknownFieldPolicy(is_strict=True).check({"prompt": "x", "max_token": 5}, Endpoint.COMPLETIONS)
    assert info.value.message.startswith("Unrecognized request argument supplied: max_token (did you mean "
                                         "max_tokens?)")
    assert info.value.param == "max_token"


ANSWER = {"a": ([chunk(0, 3, finish=FinishReason.LENGTH)], None)}


@pytest.mark.parametrize("stream", [False, True])
async def test_the_answer_names_the_fields_it_ignored(stream):
    async with scripted_frontend(ANSWER, tokenizer=ChatTokenizer()) as base_url, aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "ab", "max_token": 1, "timeout": 5, "stream": stream}
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            assert response.status == 200 and response.headers[HEADER] == "max_token, timeout"
            await response.read()
        async with session.post(f"{base_url}/v1/completions", json={**body, "max_tokens": 0}) as response:
            assert response.status == 400 and response.headers[HEADER] == "max_token, timeout"  # errors too
        known = {"model": "m", "messages": MESSAGES, "max_completion_tokens": 1, "store": False, "stream": stream}
        async with session.post(f"{base_url}/v1/chat/completions", json=known) as response:
            assert response.status == 200 and HEADER not in response.headers
            await response.read()


async def test_with_reject_unknown_fields_the_answer_is_a_400_naming_the_field():
    async with (scripted_frontend(ANSWER, tokenizer=ChatTokenizer(), reject_unknown_fields=True) as base_url,
               aiohttp.ClientSession() as session):
        body = {"model": "m", "messages": MESSAGES, "max_completion_token": 1}
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
            answer = await response.json()
        assert response.status == 400
        assert answer["error"]["param"] == "max_completion_token"
        assert answer["error"]["message"].startswith("Unrecognized request argument supplied: max_completion_token "
                                                     "(did you mean max_completion_tokens?)")
        async with session.post(f"{base_url}/v1/chat/completions", json={**body, "max_completion_tokens": 1,
                                                                         "max_completion_token": None}) as response:
            assert response.status == 400  # a null is a field too, as OpenAI answers
        del body["max_completion_token"]
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
