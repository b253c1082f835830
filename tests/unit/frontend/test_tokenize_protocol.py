"""Parsing of vLLM's /tokenize and /detokenize bodies (no sockets, no tokenizer)."""

import pytest

from services.frontend.openai_protocol import RequestError
from services.frontend.tokenize_protocol import TokenizeRequest, parse_detokenize_request, parse_tokenize_request

pytestmark = pytest.mark.timeout(10)

MODEL = "tiny"
USER = [{"role": "user", "content": "hi"}]


def test_a_prompt_or_a_chat():
    assert parse_tokenize_request({"prompt": "hello"}, MODEL) == TokenizeRequest("hello", None, True)
    assert parse_tokenize_request({"prompt": "hello", "add_special_tokens": False, "model": MODEL}, MODEL) == \
        TokenizeRequest("hello", None, False)
    chat = parse_tokenize_request({"messages": USER}, MODEL)
    assert chat.text is None and chat.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize("body, words, param", [
    ({}, ["exactly one of prompt", "messages"], "prompt"),
    ({"prompt": "a", "messages": USER}, ["exactly one"], "messages"),
    ({"prompt": None}, ["prompt", "non-empty string"], "prompt"),
    ({"prompt": ""}, ["prompt", "non-empty string"], "prompt"),
    ({"prompt": [1, 2]}, ["prompt", "non-empty string"], "prompt"),
    ({"messages": []}, ["messages"], "messages"),
    ({"prompt": "a", "add_special_tokens": "yes"}, ["add_special_tokens"], "add_special_tokens"),
])
def test_bad_tokenize_bodies_name_the_field(body, words, param):
    with pytest.raises(RequestError) as info:
        parse_tokenize_request(body, MODEL)
    assert all(word in info.value.message for word in words), info.value.message
    assert info.value.param == param and info.value.http_status == 400


def test_detokenize_takes_a_list_of_ids():
    assert parse_detokenize_request({"tokens": [1, 2, 3]}, MODEL) == [1, 2, 3]
    assert parse_detokenize_request({"tokens": []}, MODEL) == []
    for tokens in (None, "1 2"):
        with pytest.raises(RequestError, match="tokens: required, a list of token ids") as info:
            parse_detokenize_request({"tokens": tokens}, MODEL)
        assert info.value.param == "tokens"
    for tokens, path in (([1, "2"], "tokens[1]"), ([1.5], "tokens[0]"), ([3, 4, True], "tokens[2]")):
        with pytest.raises(RequestError, match=r"expected a token id \(an integer\)") as info:
            parse_detokenize_request({"tokens": tokens}, MODEL)
        assert info.value.param == path and info.value.message.startswith(f"{path}: ")
