"""An instance's refusal of a prompt names the client's field for it (`prompt`, `prompt[i]`, `messages`), not
the instance's `prompt_token_ids`: the frontend checks a prompt against the least max_model_len it knows, and an
instance serving a shorter context (one that registered after the check) refuses it later. Before, the 400 said
'prompt_token_ids: ...' with param prompt_token_ids, a field the client never sent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from services.common.errors import InvalidArgument, ResourceExhausted
from services.frontend.generation import FinishReason, GenerateSpec, Target, TokenChunk
from services.frontend.openai_protocol import parse_chat_request, parse_completion_request
from services.frontend.prompt_checks import in_client_terms
from services.instance.engine.request import SamplingParams
from tests.unit.frontend.factories import ScriptedInstances, chunk
from tests.unit.frontend.scripted_frontend import ThreadNotingTokenizer, scripted_frontend

pytestmark = pytest.mark.timeout(30)

INSTANCE_MAX_MODEL_LEN = 4  # the instance's; the frontend knows of 1000


def instance_refusal(num_prompt_tokens: int) -> InvalidArgument:
    """What an instance answers (SamplingParams.validate, over gRPC) for a prompt longer than its context."""
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(max_tokens=1).validate(INSTANCE_MAX_MODEL_LEN, num_prompt_tokens)
    return InvalidArgument(info.value.message, "cmpl-1")


class ChatTokenizer(ThreadNotingTokenizer):
    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, **kwargs):
        return self.encode("".join(m["content"] for m in messages))


class ShortContextInstance(ScriptedInstances):
    """Instance "a" with a context of INSTANCE_MAX_MODEL_LEN: a longer prompt is refused as its engine refuses it."""

    def __init__(self) -> None:
        super().__init__({})

    async def generate(self, target: Target, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        self.specs.append((target.instance_id, spec))
        if len(spec.prompt_token_ids) > INSTANCE_MAX_MODEL_LEN:
            raise instance_refusal(len(spec.prompt_token_ids))
        yield chunk(0, 1, 2, 3, finish=FinishReason.LENGTH)


def test_the_instances_prompt_field_becomes_the_clients():
    completion = parse_completion_request({"prompt": "abcdef"}, "m")
    batch = parse_completion_request({"prompt": ["ab", "abcdef"]}, "m")
    chat = parse_chat_request({"messages": [{"role": "user", "content": "abcdef"}]}, "m")
    for parsed, index, field in ((completion, 0, "prompt"), (batch, 1, "prompt[1]"), (chat, 0, "messages")):
        error = in_client_terms(instance_refusal(6), parsed, index)
        assert isinstance(error, InvalidArgument)
        assert error.message == (f"{field}: the prompt has 6 tokens, more than the model's context of 4 "
                                 "(max_model_len); shorten the prompt")
        assert error.request_id == "cmpl-1"
        assert (error.param, error.code) == (field, "context_length_exceeded")  # as the frontend's own check


def test_an_instances_refusal_of_an_empty_prompt_has_no_context_code():
    parsed = parse_completion_request({"prompt": "abcdef"}, "m")
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(max_tokens=1).validate(INSTANCE_MAX_MODEL_LEN, 0)
    error = in_client_terms(InvalidArgument(info.value.message), parsed, 0)
    assert (error.message, error.param, error.code) == (
        "prompt: the prompt is empty; send at least one token", "prompt", None)


def test_other_errors_pass_as_they_are():
    parsed = parse_completion_request({"prompt": "abcdef"}, "m")
    for error in (InvalidArgument("max_tokens: must be positive, got 0"), ResourceExhausted("prompt_token_ids: x")):
        assert in_client_terms(error, parsed, 0) is error


LONG, SHORT = "abcdef", "ab"
REFUSED = {  # the field the 400 names: (path, body)
    "prompt": ("/v1/completions", {"model": "m", "prompt": LONG, "max_tokens": 3}),
    "prompt[1]": ("/v1/completions", {"model": "m", "prompt": [SHORT, LONG], "max_tokens": 3}),
    "messages": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": LONG}],
                                          "max_tokens": 3}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", list(REFUSED))
async def test_a_prompt_an_instance_refuses_as_too_long_is_400_naming_the_clients_field(field, stream):
    path, body = REFUSED[field]
    async with scripted_frontend(tokenizer=ChatTokenizer(), instances=ShortContextInstance()) as base_url:
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + path, json={**body, "stream": stream}) as response:
                answer = await response.json()
    assert response.status == 400, answer
    assert answer["error"]["param"] == field
    assert answer["error"]["code"] == "context_length_exceeded"  # it was null: the frontend's own check says so
    assert answer["error"]["message"].startswith(f"{field}: the prompt has 6 tokens, more than the model's context")
